"""`python -m tpkit ...` (what `torchrun -m tpkit train ...` runs)."""

from tpkit.cli import entry

if __name__ == "__main__":
    entry()
