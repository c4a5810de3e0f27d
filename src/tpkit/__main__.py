"""`python -m tpkit ...` (what `torchrun -m tpkit train ...` runs)."""

from tpkit.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
