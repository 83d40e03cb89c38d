# cython: language_level=3
"""Compiled core of the memory planner: best-fit placement in a given order, and a search over
canonical solutions (MiniMalloc, Moffitt, ASPLOS 2024).

Units: every size and offset here is already aligned and divided by the alignment, so the core
never thinks about alignment. Lifetimes are half-open node ranges [start, end). Inputs are
validated by magnitude.planner; these functions trust them.
"""
from libc.stdlib cimport malloc, realloc, free, qsort
from libc.string cimport memmove
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC

import numpy as np

ctypedef long long i64


def best_fit(const i64[::1] size, const i64[::1] start, const i64[::1] end,
             const i64[::1] order, bint on_top=False):
    """Offsets (by buffer index) placing buffers in `order`, each into the smallest gap between
    already placed buffers whose lifetimes overlap it (the gap at offset 0 included), else on
    top of them. Ties between equal gaps go to the lowest offset. on_top skips the gaps (bump
    allocation)."""
    cdef Py_ssize_t n = order.shape[0]
    offsets = np.zeros(size.shape[0], dtype=np.int64)
    cdef i64[::1] out = offsets
    # Placed buffers kept sorted by offset (ties: placement order) so one scan finds the gaps.
    cdef i64 *p_off = <i64 *> malloc(max(n, 1) * sizeof(i64))
    cdef i64 *p_idx = <i64 *> malloc(max(n, 1) * sizeof(i64))
    if p_off == NULL or p_idx == NULL:
        free(p_off)
        free(p_idx)
        raise MemoryError()
    cdef Py_ssize_t k = 0, i, j, pos
    cdef i64 b, o, sz, cursor, best, best_gap, gap, s0, e0
    with nogil:
        for i in range(n):
            b = order[i]
            sz = size[b]
            s0 = start[b]
            e0 = end[b]
            cursor = 0
            best = -1
            best_gap = 0
            for j in range(k):
                o = p_idx[j]
                if start[o] >= e0 or s0 >= end[o]:
                    continue
                gap = p_off[j] - cursor
                if not on_top and gap >= sz and (best < 0 or gap < best_gap):
                    best = cursor
                    best_gap = gap
                if p_off[j] + size[o] > cursor:
                    cursor = p_off[j] + size[o]
            if best < 0:
                best = cursor
            out[b] = best
            pos = k
            while pos > 0 and p_off[pos - 1] > best:
                pos -= 1
            memmove(&p_off[pos + 1], &p_off[pos], (k - pos) * sizeof(i64))
            memmove(&p_idx[pos + 1], &p_idx[pos], (k - pos) * sizeof(i64))
            p_off[pos] = best
            p_idx[pos] = b
            k += 1
    free(p_off)
    free(p_idx)
    return offsets


# ---------------------------------------------------------------------------------------------
# Canonical search. A canonical solution places buffers in non-decreasing offset order, each at
# the lowest offset its already placed overlapping buffers allow (its "min offset"): every
# feasible packing can be pushed down into one, so searching only these loses nothing.
# Pruning, as in MiniMalloc: (1) section inference: in every section (a maximal set of buffers
# live together) the floor plus the sizes still to place must fit the capacity; (2) dominance:
# never place a buffer at or above the top another unplaced buffer could already reach, that
# would leave a gap it could have filled; (3) the floor of a section is at least the lowest min
# offset of its unplaced buffers.

cdef enum:
    NOT_FOUND = 0
    FOUND = 1
    ABORTED = 2  # node limit reached
    TIMED_OUT = 3
    OUT_OF_WORK = 4  # work budget spent


cdef struct Cand:
    i64 off
    i64 rank
    i64 idx


cdef int cmp_cand(const void *a, const void *b) noexcept nogil:
    cdef const Cand *x = <const Cand *> a
    cdef const Cand *y = <const Cand *> b
    if x.off != y.off:
        return -1 if x.off < y.off else 1
    if x.rank != y.rank:
        return -1 if x.rank < y.rank else 1
    return 0


cdef struct Pre:
    i64 k1
    i64 k2
    i64 k3
    i64 idx


cdef int cmp_pre(const void *a, const void *b) noexcept nogil:
    # Keys descending, then buffer index ascending.
    cdef const Pre *x = <const Pre *> a
    cdef const Pre *y = <const Pre *> b
    if x.k1 != y.k1:
        return -1 if x.k1 > y.k1 else 1
    if x.k2 != y.k2:
        return -1 if x.k2 > y.k2 else 1
    if x.k3 != y.k3:
        return -1 if x.k3 > y.k3 else 1
    return -1 if x.idx < y.idx else (1 if x.idx > y.idx else 0)


# MiniMalloc's preorders, all keys descending: W = lifetime width, A = area (size x width),
# T = the largest total of unplaced bytes among the buffer's sections (recomputed for every
# sub-problem, so it follows the search).
HEURISTICS = ("WAT", "TAW", "TWA")


cdef double now() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef class CanonicalSearch:
    """Decision search: find offsets with every buffer below `capacity`, or prove none exist.

    Built once per problem (sections and overlaps), then run() with different capacities and
    buffer preorders. Deterministic for given node and work limits; only the deadline, a
    safety net, can make a run stop at a machine-dependent point.
    """
    cdef Py_ssize_t n, m
    cdef object _keep  # numpy arrays that own the memory the pointers below point into
    cdef i64 *size
    cdef i64 *sec_lo
    cdef i64 *sec_hi
    cdef i64 *ov_ptr
    cdef i64 *ov_idx
    cdef i64 *sm_ptr
    cdef i64 *sm_idx
    cdef i64 *sec_total0
    cdef i64 *width
    cdef i64 *area
    cdef int heuristic
    # search state
    cdef i64 *rank
    cdef i64 *offset
    cdef i64 *min_off
    cdef i64 *floor
    cdef i64 *total
    cdef i64 *best
    cdef i64 *mark
    cdef i64 *cuts  # per section boundary s|s+1: unplaced buffers that cross it
    # Each section's member list keeps its unplaced buffers first (n_live[s] of them): placing
    # swaps the buffer behind them, and since the search undoes in reverse order, unplacing is
    # just n_live[s] += 1. where[pos_ptr[b] + s - sec_lo[b]] is b's slot in section s.
    cdef i64 *n_live
    cdef i64 *pos_ptr
    cdef i64 *where
    cdef i64 *all
    cdef i64 *affected
    cdef i64 stamp
    cdef i64 *undo  # triples: kind (0 min_off, 1 floor), index, old value
    cdef Py_ssize_t undo_top, undo_cap
    cdef i64 capacity, node_limit, work_limit
    cdef public i64 nodes  # search nodes the last run() visited
    # Work done by the last run(): buffers and sections scanned, a count that tracks time
    # closely on any problem (nodes do not: their cost varies 20x between problems) yet does
    # not depend on the machine, so a work budget stops the search at the same point anywhere.
    cdef public i64 work
    cdef double deadline
    cdef public long long backtracks

    def __cinit__(self):
        self.undo = NULL
        self.undo_top = 0
        self.undo_cap = 0

    def __dealloc__(self):
        free(self.undo)

    def __init__(self, const i64[::1] size, const i64[::1] start, const i64[::1] end):
        n = size.shape[0]
        sizes = np.array(size, dtype=np.int64)  # a copy: the caller's array may be read-only
        sec_lo, sec_hi, members = _sections(np.asarray(start), np.asarray(end))
        m = len(members)
        sm_ptr = np.zeros(m + 1, dtype=np.int64)
        sm_ptr[1:] = np.cumsum([len(s) for s in members])
        sm_idx = np.array([b for s in members for b in s], dtype=np.int64)
        sec_total = np.array([int(sizes[s].sum()) for s in members], dtype=np.int64)
        ov_ptr, ov_idx = _overlaps(sec_lo, sec_hi, members, n)
        state = [np.zeros(n, dtype=np.int64) for _ in range(6)]
        pos_ptr = np.zeros(n + 1, dtype=np.int64)
        pos_ptr[1:] = np.cumsum(sec_hi - sec_lo)
        where = np.zeros(max(int(pos_ptr[n]), 1), dtype=np.int64)
        sec_of = np.repeat(np.arange(m, dtype=np.int64), np.diff(sm_ptr))
        where[pos_ptr[sm_idx] + sec_of - sec_lo[sm_idx]] = np.arange(len(sm_idx))
        width = np.asarray(end, dtype=np.int64) - np.asarray(start, dtype=np.int64)
        area = width * sizes
        sec_state = [np.zeros(max(m, 1), dtype=np.int64) for _ in range(5)]
        self._keep = [sizes, sec_lo, sec_hi, sm_ptr, sm_idx, sec_total, ov_ptr, ov_idx,
                      state, sec_state, width, area, pos_ptr, where]
        self.n = n
        self.m = m
        self.size = _ptr(sizes)
        self.sec_lo = _ptr(sec_lo)
        self.sec_hi = _ptr(sec_hi)
        self.sm_ptr = _ptr(sm_ptr)
        self.sm_idx = _ptr(sm_idx)
        self.sec_total0 = _ptr(sec_total)
        self.ov_ptr = _ptr(ov_ptr)
        self.ov_idx = _ptr(ov_idx)
        self.rank = _ptr(state[0])
        self.offset = _ptr(state[1])
        self.min_off = _ptr(state[2])
        self.best = _ptr(state[3])
        self.affected = _ptr(state[4])
        self.floor = _ptr(sec_state[0])
        self.total = _ptr(sec_state[1])
        self.mark = _ptr(sec_state[2])
        self.cuts = _ptr(sec_state[3])
        self.n_live = _ptr(sec_state[4])
        self.pos_ptr = _ptr(pos_ptr)
        self.where = _ptr(where)
        self.all = _ptr(state[5])
        self.width = _ptr(width)
        self.area = _ptr(area)
        self.backtracks = 0

    @property
    def n_buffers(self):
        return self.n

    @property
    def n_sections(self):
        return self.m

    def section_totals(self):
        """Bytes (in units) live in each section: the max is the lower bound."""
        return np.asarray(self._keep[5])

    def run(self, i64 capacity, str heuristic, double deadline, i64 node_limit,
            i64 work_limit=-1):
        """Search with buffers at equal min offsets tried in the order of `heuristic` (one of
        HEURISTICS). Returns (status, offsets or None); status is 'found', 'infeasible',
        'aborted' (node limit), 'budget' (work limit; -1 = none) or 'timeout'."""
        cdef Py_ssize_t i
        cdef i64 s
        cdef int status
        self.heuristic = HEURISTICS.index(heuristic)
        for i in range(self.n):
            self.min_off[i] = 0
        for i in range(self.m):
            self.n_live[i] = self.sm_ptr[i + 1] - self.sm_ptr[i]
            self.floor[i] = 0
            self.total[i] = self.sec_total0[i]
            self.mark[i] = 0
        self.stamp = 0
        self.undo_top = 0
        self.capacity = capacity
        self.nodes = 0
        self.node_limit = node_limit
        self.work = 0
        self.work_limit = work_limit
        self.deadline = deadline
        # The search undoes every change on its way back, whatever ended it; this reset makes a
        # run independent of the previous one all the same.
        for i in range(self.m - 1):
            self.cuts[i] = 0
        for i in range(self.n):
            self.offset[i] = -1
            self.all[i] = i
            for s in range(self.sec_lo[i], self.sec_hi[i] - 1):
                self.cuts[s] += 1
        with nogil:
            status = self.solve_parts(self.all, self.n, 0, self.m)
        if status == -1:
            raise MemoryError()
        if status == FOUND:
            return "found", np.array(<i64[:self.n]> self.best, dtype=np.int64)
        return {NOT_FOUND: "infeasible", ABORTED: "aborted", TIMED_OUT: "timeout",
                OUT_OF_WORK: "budget"}[status], None

    cdef int push(self, i64 kind, i64 idx, i64 old) noexcept nogil:
        cdef i64 *grown
        if self.undo_top + 3 > self.undo_cap:
            grown = <i64 *> realloc(self.undo, (self.undo_cap * 2 + 3072) * sizeof(i64))
            if grown == NULL:
                return -1
            self.undo = grown
            self.undo_cap = self.undo_cap * 2 + 3072
        self.work += 1
        self.undo[self.undo_top] = kind
        self.undo[self.undo_top + 1] = idx
        self.undo[self.undo_top + 2] = old
        self.undo_top += 3
        return 0

    cdef void restore(self, Py_ssize_t top) noexcept nogil:
        while self.undo_top > top:
            self.undo_top -= 3
            if self.undo[self.undo_top] == 0:
                self.min_off[self.undo[self.undo_top + 1]] = self.undo[self.undo_top + 2]
            else:
                self.floor[self.undo[self.undo_top + 1]] = self.undo[self.undo_top + 2]

    cdef int place(self, i64 b) noexcept nogil:
        """Put b at its min offset and propagate: raise the min offsets of unplaced buffers it
        overlaps, the floors of its sections, and (rule 3) the floors of sections whose lowest
        unplaced min offset rose. Returns 1 when no unplaced buffer overlaps b ("hatless"),
        0 otherwise, -1 when out of memory."""
        cdef i64 height = self.offset[b] + self.size[b]
        cdef i64 k, o, s, lo, j, n_aff = 0, slot, last
        cdef int hatless = 1
        self.stamp += 1
        self.work += self.sec_hi[b] - self.sec_lo[b] + self.ov_ptr[b + 1] - self.ov_ptr[b]
        for s in range(self.sec_lo[b], self.sec_hi[b]):
            if self.push(1, s, self.floor[s]) < 0:
                return -1
            if height > self.floor[s]:
                self.floor[s] = height
            self.total[s] -= self.size[b]
            slot = self.where[self.pos_ptr[b] + s - self.sec_lo[b]]
            last = self.sm_ptr[s] + self.n_live[s] - 1
            o = self.sm_idx[last]
            self.sm_idx[slot] = o
            self.where[self.pos_ptr[o] + s - self.sec_lo[o]] = slot
            self.sm_idx[last] = b
            self.where[self.pos_ptr[b] + s - self.sec_lo[b]] = last
            self.n_live[s] -= 1
        for k in range(self.ov_ptr[b], self.ov_ptr[b + 1]):
            o = self.ov_idx[k]
            if self.offset[o] >= 0:
                continue
            hatless = 0
            if self.min_off[o] >= height:
                continue
            if self.push(0, o, self.min_off[o]) < 0:
                return -1
            self.min_off[o] = height
            self.work += self.sec_hi[o] - self.sec_lo[o]
            for s in range(self.sec_lo[o], self.sec_hi[o]):
                # A floor already at or above height cannot rise from this change.
                if self.mark[s] != self.stamp and self.floor[s] < height:
                    self.mark[s] = self.stamp
                    self.affected[n_aff] = s
                    n_aff += 1  # fits: there are never more sections than buffers
        for j in range(n_aff):
            s = self.affected[j]
            self.work += self.n_live[s]
            lo = -1
            for k in range(self.sm_ptr[s], self.sm_ptr[s] + self.n_live[s]):
                o = self.sm_idx[k]
                if lo < 0 or self.min_off[o] < lo:
                    lo = self.min_off[o]
                    if lo <= self.floor[s]:
                        break  # the floor stays
            if lo > self.floor[s]:
                if self.push(1, s, self.floor[s]) < 0:
                    return -1
                self.floor[s] = lo
        return hatless

    cdef bint check(self, i64 off, i64 slo, i64 shi) noexcept nogil:
        cdef i64 s, f
        self.work += shi - slo
        for s in range(slo, shi):
            f = self.floor[s]
            if self.total[s] > 0 and off > f:  # later buffers go no lower than this one
                f = off
            if f + self.total[s] > self.capacity:
                return False
        return True

    cdef int dfs(self, i64 *part, Py_ssize_t nb, i64 slo, i64 shi, i64 min_offset,
                 i64 min_rank) noexcept nogil:
        """Place the unplaced buffers of one partition (buffers `part`, sections [slo, shi))."""
        cdef Py_ssize_t i, k = 0, top
        cdef i64 b, o, min_height = -1, h
        cdef int status = NOT_FOUND, hatless
        cdef Cand *cand
        self.nodes += 1
        self.work += 2 * nb
        if self.nodes > self.node_limit:
            return ABORTED
        if self.work_limit >= 0 and self.work > self.work_limit:
            return OUT_OF_WORK
        if (self.nodes & 63) == 0 and now() > self.deadline:
            return TIMED_OUT
        cand = <Cand *> malloc(max(nb, 1) * sizeof(Cand))
        if cand == NULL:
            return -1
        # Only buffers whose min offset lies below every unplaced buffer's reachable top can go
        # next (dominance); usually a handful, so filter first and sort only those.
        for i in range(nb):
            o = part[i]
            if self.offset[o] < 0:
                k += 1
                h = self.min_off[o] + self.size[o]
                if min_height < 0 or h < min_height:
                    min_height = h
        if k == 0:
            free(cand)
            return FOUND
        k = 0
        for i in range(nb):
            o = part[i]
            if self.offset[o] >= 0 or self.min_off[o] >= min_height:
                continue
            if self.min_off[o] < min_offset or (self.min_off[o] == min_offset
                                                and self.rank[o] < min_rank):
                continue  # canonical: offsets never decrease along a branch
            cand[k].off = self.min_off[o]
            cand[k].rank = self.rank[o]
            cand[k].idx = o
            k += 1
        qsort(cand, k, sizeof(Cand), cmp_cand)
        for i in range(k):
            b = cand[i].idx
            top = self.undo_top
            self.offset[b] = cand[i].off
            self.best[b] = cand[i].off  # the last write of each buffer is the successful one
            hatless = self.place(b)
            if hatless < 0:
                status = -1
            elif self.check(cand[i].off, slo, shi):
                status = self.decompose(part, nb, slo, shi, cand[i].off, cand[i].rank, b)
            self.restore(top)
            for h in range(self.sec_lo[b], self.sec_hi[b]):
                self.total[h] += self.size[b]
                self.n_live[h] += 1  # b still sits right behind the live members
            self.offset[b] = -1
            if status != NOT_FOUND:
                free(cand)
                return status
            if hatless:
                break  # b touches no unplaced buffer, so no other choice here can do better
        self.backtracks += 1
        free(cand)
        return NOT_FOUND

    cdef int decompose(self, i64 *part, Py_ssize_t nb, i64 slo, i64 shi, i64 off, i64 rank,
                       i64 b) noexcept nogil:
        """After placing b: if no unplaced buffer crosses some section boundary any more, the
        two sides are independent and are solved one after the other; a failure on one side
        then fails the whole, without retrying the other side's alternatives."""
        cdef i64 s
        cdef bint split = False
        cdef int status
        for s in range(self.sec_lo[b], self.sec_hi[b] - 1):
            self.cuts[s] -= 1
            if self.cuts[s] == 0:
                split = True
        if split:
            status = self.solve_parts(part, nb, slo, shi)
        else:
            status = self.dfs(part, nb, slo, shi, off, rank)
        for s in range(self.sec_lo[b], self.sec_hi[b] - 1):
            self.cuts[s] += 1
        return status

    cdef int solve_parts(self, i64 *part, Py_ssize_t nb, i64 slo, i64 shi) noexcept nogil:
        """Split sections [slo, shi) at every boundary no unplaced buffer crosses and search
        each piece on its own, left to right."""
        cdef i64 a = slo, e, o
        cdef Py_ssize_t i, k
        cdef int status = FOUND
        cdef i64 *sub = <i64 *> malloc(max(nb, 1) * sizeof(i64))
        if sub == NULL:
            return -1
        while a < shi and status == FOUND:
            e = a
            while e < shi - 1 and self.cuts[e] != 0:
                e += 1
            k = 0
            for i in range(nb):
                o = part[i]
                if self.offset[o] < 0 and self.sec_lo[o] <= e and self.sec_hi[o] > a:
                    sub[k] = o
                    k += 1
            if k > 0:
                status = self.solve_part(sub, k, a, e + 1)
            a = e + 1
        free(sub)
        return status

    cdef int solve_part(self, i64 *part, Py_ssize_t k, i64 slo, i64 shi) noexcept nogil:
        """Rank the partition's buffers by the heuristic (with the current section totals),
        search it, then give the buffers back the ranks the enclosing search gave them."""
        cdef Py_ssize_t i
        cdef i64 b, s, t
        cdef int status
        cdef Pre *pre = <Pre *> malloc(k * sizeof(Pre))
        cdef i64 *saved = <i64 *> malloc(k * sizeof(i64))
        if pre == NULL or saved == NULL:
            free(pre)
            free(saved)
            return -1
        self.work += 4 * k  # ranking: the scan below and the sort
        for i in range(k):
            b = part[i]
            t = 0
            for s in range(self.sec_lo[b], self.sec_hi[b]):
                if self.total[s] > t:
                    t = self.total[s]
            pre[i].idx = b
            if self.heuristic == 0:
                pre[i].k1, pre[i].k2, pre[i].k3 = self.width[b], self.area[b], t
            elif self.heuristic == 1:
                pre[i].k1, pre[i].k2, pre[i].k3 = t, self.area[b], self.width[b]
            else:
                pre[i].k1, pre[i].k2, pre[i].k3 = t, self.width[b], self.area[b]
        qsort(pre, k, sizeof(Pre), cmp_pre)
        for i in range(k):
            saved[i] = self.rank[part[i]]
        for i in range(k):
            self.rank[pre[i].idx] = i
        status = self.dfs(part, k, slo, shi, 0, -1)
        for i in range(k):
            self.rank[part[i]] = saved[i]
        free(pre)
        free(saved)
        return status


cdef i64 *_ptr(arr):
    cdef i64[::1] view = arr
    if view.shape[0] == 0:
        return NULL
    return &view[0]


def _sections(start, end):
    """Sections = the sets of buffers live together at a moment when no buffer has just ended
    before a later one starts (the local maxima of the live set); a buffer spans a contiguous
    range of them [sec_lo, sec_hi). Any two buffers that overlap in time share a section, and
    every other moment's live set is a subset of a section's, so checking sections suffices."""
    n = len(start)
    # Sweep: at equal times ends come before starts, since lifetimes are half-open.
    events = sorted([(int(end[b]), 0, b) for b in range(n)] + [(int(start[b]), 1, b)
                                                                for b in range(n)])
    live: dict = {}
    members: list = []
    sec_lo = np.zeros(n, dtype=np.int64)
    sec_hi = np.zeros(n, dtype=np.int64)
    grew = False
    for _, kind, b in events:
        if kind == 1:
            live[b] = True
            sec_lo[b] = len(members)
            grew = True
        else:
            if grew:
                members.append(sorted(live))
                grew = False
            del live[b]
            sec_hi[b] = len(members)
    return sec_lo, sec_hi, members


def _overlaps(sec_lo, sec_hi, members, n):
    """Per buffer, the buffers it overlaps in time (CSR arrays), ascending index."""
    adj = [set() for _ in range(n)]
    for s in members:
        for b in s:
            adj[b].update(s)
    ptr = np.zeros(n + 1, dtype=np.int64)
    idx = []
    for b in range(n):
        adj[b].discard(b)
        idx.extend(sorted(adj[b]))
        ptr[b + 1] = len(idx)
    return ptr, np.array(idx, dtype=np.int64)
