"""Loading, saving and validating configs in a fresh interpreter imports no heavy module."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

from helpers import REPO

CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "**", "*.yaml"), recursive=True)
                 + glob.glob(os.path.join(REPO, "configs", "**", "*.yml"), recursive=True))


# ------------------------------------------------------------------------------------------
# import hygiene
# ------------------------------------------------------------------------------------------

def test_config_does_not_import_heavy_modules(tmp_path):
    out = tmp_path / "saved.yaml"
    src = CONFIGS[0] if CONFIGS else ""
    code = (
        "import sys, json\n"
        "import laminar_hpc.config as c\n"
        f"cfg = c.load_config({src!r}, ['trainer.lr=3e-4']) if {bool(src)!r} else c.config_from_dict({{}})\n"
        "c.config_from_dict({'task': {'type': 'jsonl', 'path': 'x.jsonl'}})\n"
        f"c.save_config(cfg, {str(out)!r})\n"
        "c.load_config(" + repr(str(out)) + ")\n"
        "try:\n"
        "    c.config_from_dict({'trainer': {'lrr': 1}})\n"
        "except c.ConfigError:\n"
        "    pass\n"
        "heavy = ['torch', 'mpi4py', 'vllm']\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in heavy)))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert loaded == [], f"laminar_hpc.config pulled in {loaded}"
    assert out.is_file()
