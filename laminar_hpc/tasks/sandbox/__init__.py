"""The python tool's sandbox: the tool itself, which runs a model's code in a child process
(`python_tool.py`), and the walls around that child: bubblewrap and seccomp (`bwrap.py`),
Landlock (`landlock.py`) and the limits on a call as a whole (`call_limits.py`)."""
