"""Task sources: where a campaign's problems come from (`build.py`: the source a config's `task:`
names and the validation split), one file per task type (arith, builtin, toolcalc, synthetic,
dataset with its row files and layouts), and the supervised warm-up's demonstrations."""
