"""The local launcher (``tdfunc.testing.launch``) lets ranks that returned a result exit on their
own: killing them mid-exit skipped their exit handlers, and every named semaphore a rank had
made (tqdm makes one in each compiling process) was reported by the resource tracker as
``There appear to be N leaked semaphore objects`` after ``make demo``'s multi-process
examples.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# a rank that holds a named semaphore when it returns, as a rank that compiled holds tqdm's
SCRIPT = textwrap.dedent(
    """
    import multiprocessing

    from tdfunc.testing import launch


    def rank_main(rank, world_size):
        global LOCK
        LOCK = multiprocessing.get_context("spawn").RLock()  # registered with the tracker
        return rank


    if __name__ == "__main__":
        print(launch(rank_main, 2, timeout=120))
    """
)


def test_launch_lets_finished_ranks_exit_cleanly(tmp_path):
    script = tmp_path / "two_ranks.py"
    script.write_text(SCRIPT, encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "default"}
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[0, 1]"
    assert "leaked semaphore" not in done.stderr, done.stderr
    assert "resource_tracker" not in done.stderr, done.stderr
