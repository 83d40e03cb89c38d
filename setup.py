"""Build of the Cython kernels in magnitude/_ext.

No -march=native: SIMD code is compiled per target inside the C header (function attributes) and
chosen at run time, so one build runs on any x86-64 (and the scalar path anywhere else).
OpenMP is probed: when the compiler cannot link it we build serially and say so.
MAGNITUDE_DEBUG=1 builds with bounds checks and assertions on, without optimisation.
"""
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from glob import glob

from setuptools import Extension, setup

DEBUG = os.environ.get("MAGNITUDE_DEBUG", "") not in ("", "0")


def compiler_supports_openmp():
    """Compile and link a tiny OpenMP program with the C compiler Python was built with."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if not shutil.which(cc):
        cc = "cc"
    src = "#include <omp.h>\nint main(void){int n=0;\n#pragma omp parallel reduction(+:n)\nn+=1;\nreturn n>0?0:1;}\n"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "probe.c")
        with open(path, "w") as f:
            f.write(src)
        cmd = [cc, "-fopenmp", path, "-o", os.path.join(tmp, "probe")]
        return subprocess.run(cmd, capture_output=True).returncode == 0


def extensions():
    from Cython.Build import cythonize

    openmp = compiler_supports_openmp()
    if not openmp:
        print("magnitude: WARNING: the C compiler has no OpenMP; kernels run on one thread",
              file=sys.stderr)
    cflags = ["-O0", "-g"] if DEBUG else ["-O3", "-fno-math-errno", "-fno-trapping-math"]
    cflags += ["-std=c11", "-ffp-contract=off", "-Wno-unused-function", "-Wno-unknown-pragmas"]
    ldflags = []
    if openmp:
        cflags.append("-fopenmp")
        ldflags.append("-fopenmp")
    exts = [
        Extension(
            "magnitude._ext." + os.path.splitext(os.path.basename(pyx))[0],
            [pyx],
            include_dirs=["magnitude/_ext"],
            extra_compile_args=cflags,
            extra_link_args=ldflags,
        )
        for pyx in sorted(glob("magnitude/_ext/*.pyx"))
    ]
    directives = {
        "language_level": 3,
        "boundscheck": DEBUG,
        "wraparound": DEBUG,
        "initializedcheck": DEBUG,
        "cdivision": not DEBUG,
    }
    return cythonize(exts, compiler_directives=directives, compile_time_env={"HAVE_OPENMP": openmp})


setup(ext_modules=extensions())
