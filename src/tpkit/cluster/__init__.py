"""Simulated hosts on one Linux machine, for learning and for tests (`tpkit cluster`).

    layout.py   the names and addresses of a cluster, its state file (pure Python)
    checks.py   what making hosts needs (root's capabilities, ip/tc/unshare), one line
                naming what is missing
    hosts.py    up, down, run, status: network namespaces joined through a switch
                namespace, links shaped with `tc ... tbf`

A host is a network namespace `<name>-h<i>` (its own TCP/IP stack, 10.212.0.<i+1>) whose
commands also get their own UTS hostname, /dev/shm and /etc/hosts (a mount namespace per
command, the same directories each time). Every object made is named `<name>-...` and
listed in a state file before it is made, so `down`, or the next `up`, removes it even
after a crash of `up`; nothing else is ever removed. Nothing here imports the rest of
tpkit but `tpkit.spec.errors`.
"""
