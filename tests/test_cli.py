"""The `magnitude` command as a user runs it."""
import subprocess
import sys


def magnitude(*args, env=None):
    return subprocess.run([sys.executable, "-m", "magnitude", *args], capture_output=True,
                          text=True, timeout=300, env=env)


def test_run_streams_text_and_prints_a_summary():
    p = magnitude("run", "-p", "The capital of France is", "-n", "8", "--threads", "1")
    assert p.returncode == 0, p.stderr
    assert "Paris" in p.stdout
    summary = p.stderr.strip().splitlines()[-1]
    for field in ("tok/s", "arena", "lower bound", "KV", "peak RSS"):
        assert field in summary


def test_plan_prints_figures_and_draws(tmp_path):
    png, timeline = tmp_path / "plan.png", tmp_path / "timeline.png"
    p = magnitude("plan", "--tokens", "64", "--png", str(png), "--timeline", str(timeline),
                  "--report", "--ctx", "256")
    assert p.returncode == 0, p.stderr
    assert "lower bound" in p.stdout and "tensors" in p.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert timeline.stat().st_size > 1000


def test_missing_model_says_how_to_fix_it(tmp_path):
    p = magnitude("run", "-p", "hi", "--model", str(tmp_path / "nope.gguf"))
    assert p.returncode == 2
    assert "nope.gguf" in p.stderr and "Traceback" not in p.stderr


def test_empty_prompt_is_a_clear_error():
    p = magnitude("run", "-p", "", "--threads", "1", "--ctx", "64")
    assert p.returncode == 2
    assert "prompt is empty" in p.stderr and "Traceback" not in p.stderr
