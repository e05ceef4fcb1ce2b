"""`--background-load N`: N busy-looping processes beside the engine, started and stopped by the bench,
each ending by itself after `max_seconds` even if the bench is killed."""
import contextlib
import subprocess
import sys

BUSY_LOOP = "import sys, time\nend = time.time() + float(sys.argv[1])\nwhile time.time() < end: pass"


@contextlib.contextmanager
def background_load(num_procs: int, max_seconds: float = 1800):
    procs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(max_seconds)]) for _ in range(num_procs)]
    try:
        yield procs
    finally:
        for process in procs:
            process.kill()
            process.wait()


def loaded_summary(quiet: dict, loaded: dict, num_procs: int) -> dict:
    return {"num_procs": num_procs, "quiet_output_tok_s": quiet["output_tok_s"],
            "loaded_output_tok_s": loaded["output_tok_s"], "ratio": loaded["output_tok_s"] / quiet["output_tok_s"]}


def loaded_line(summary: dict) -> str:
    return (f"background load: {summary['num_procs']} busy process(es): {summary['loaded_output_tok_s']:.1f} "
            f"output tok/s = {100 * summary['ratio']:.1f}% of the quiet {summary['quiet_output_tok_s']:.1f}")
