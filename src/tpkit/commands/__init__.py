"""The `tpkit` commands: argparse front-ends over the library, one module each.

A command module defines `add_arguments(parser)` and `run(args) -> int`.
"""
