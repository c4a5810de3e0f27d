"""`tpkit cluster`: simulated hosts on this machine (root, Linux), for learning and tests.

    tpkit cluster up --hosts 2 --link 1gbit    # hosts tpkit-h0, tpkit-h1: 10.212.0.1, .2
    tpkit cluster run tpkit-h1 -- hostname     # tpkit-h1
    tpkit cluster run tpkit-h0 -- torchrun --nnodes 2 --node_rank 0 \\
        --master_addr tpkit-h0 ... -m tpkit train ...
    tpkit cluster status
    tpkit cluster down

Each host has its own network stack, hostname, /dev/shm and /etc/hosts
(`tpkit.cluster`); `down` stops what still runs in them and removes all `up` made.
"""

from __future__ import annotations

import argparse
import sys

from tpkit.cluster import hosts
from tpkit.cluster.layout import Layout, check_name, read_state


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """up, run, status, down; --name on each (default tpkit)."""
    sub = parser.add_subparsers(dest="action", required=True, metavar="{up,run,status,down}",
                                help="what to do (`tpkit cluster ACTION --help`)")
    up = sub.add_parser("up", help="make N hosts joined by a switch")
    up.add_argument("--hosts", type=int, default=2, help="how many hosts")
    up.add_argument("--link", default=None,
                    help="each host's link rate, shaped with tc tbf (10gbit, 1gbit, 100mbit; "
                         "default: unshaped)")
    run = sub.add_parser("run", help="run a command inside a host: run HOST -- CMD ...")
    run.add_argument("host", help="a host's name (tpkit-h0: the cluster is its prefix) or "
                                  "number (0, in the cluster --name, given before it)")
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")
    sub.add_parser("status", help="the clusters that are up, their hosts and processes")
    sub.add_parser("down", help="stop what runs in the hosts and remove all up made")
    for p in (up, run, *[sub.choices[k] for k in ("status", "down")]):
        p.add_argument("--name", default="tpkit", type=check_name,
                       help="the cluster's name, the prefix of all it makes")


def run(args: argparse.Namespace) -> int:
    """Do the action; print what was done."""
    if args.action == "run":
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        name = args.host.rsplit("-h", 1)[0] if "-h" in args.host else args.name
        hosts.run(name, args.host, cmd)  # returns only on an error (raised)
    if args.action == "up":
        lines = hosts.up(Layout(args.name, args.hosts, args.link))
    elif args.action == "down":
        found = read_state(args.name)
        lines = hosts.down(found[0]) if found else [f"no cluster named {args.name} is up"]
    else:
        lines = hosts.status()
    sys.stdout.write("".join(f"{line}\n" for line in lines))
    return 0
