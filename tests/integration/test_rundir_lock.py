"""The campaign lock of a run directory, held by another process."""
from __future__ import annotations

import os
import subprocess
import sys

from laminar_hpc.launch.prepare import CampaignLock

from helpers import REPO


# ------------------------------------------------------------------------------------------
# CampaignLock across processes
# ------------------------------------------------------------------------------------------


def test_our_lock_blocks_other_process(tmp_path):
    code = ("import sys\nfrom laminar_hpc.launch.prepare import CampaignLock\nfrom laminar_hpc.rundir import RunDirError\n"
            "try:\n    CampaignLock(sys.argv[1]).__enter__()\nexcept RunDirError as e:\n    print(e)\n"
            "    sys.exit(3)\n")
    with CampaignLock(tmp_path):
        proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                              cwd=REPO, timeout=60)
        assert proc.returncode == 3, proc.stderr
        assert f"pid {os.getpid()}" in proc.stdout
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                          cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
