"""The names and addresses of a simulated cluster, and its state file (pure Python).

    Layout("tpkit", 2, "1gbit")
      namespaces   tpkit-h0 tpkit-h1 (hosts), tpkit-sw (the switch: a bridge, no address)
      addresses    10.212.0.1 tpkit-h0, 10.212.0.2 tpkit-h1 (inside those namespaces only)
      files        /run/tpkit-cluster/tpkit/ (state.json, h<i>/hosts)
                   /dev/shm/.tpkit-cluster/tpkit/h<i>/ (each host's /dev/shm)
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from tpkit.spec.errors import UserError

NAME = re.compile(r"[a-z][a-z0-9]{0,7}")  # short: interface names have 15 characters
RATE = re.compile(r"\d+(\.\d+)?[kmg]?bit")
MAX_HOSTS = 200
SUBNET = "10.212.0"  # private; exists only inside the namespaces a cluster makes


def state_root() -> Path:
    """Where clusters' state files live (TPKIT_CLUSTER_DIR, else /run/tpkit-cluster)."""
    return Path(os.environ.get("TPKIT_CLUSTER_DIR") or "/run/tpkit-cluster")


def shm_root() -> Path:
    """Where the hosts' /dev/shm directories live (a tmpfs, like /dev/shm itself)."""
    return Path(os.environ.get("TPKIT_CLUSTER_SHM") or "/dev/shm/.tpkit-cluster")


def check_name(name: str) -> str:
    """`name` if it can prefix a cluster's objects, else a UserError."""
    if not NAME.fullmatch(name):
        raise UserError(f"--name {name!r}: 1 to 8 lower-case letters or digits, starting "
                        f"with a letter (it prefixes the namespaces' and links' names)")
    return name


def check_link(link: str | None) -> str | None:
    """A tc rate ('1gbit', '500mbit') or None (unshaped)."""
    if link in (None, "", "none"):
        return None
    if not RATE.fullmatch(link):
        raise UserError(f"--link {link!r}: a rate such as 10gbit, 1gbit or 100mbit, or none")
    return link


@dataclass(frozen=True)
class Layout:
    """One cluster: its name (the prefix of all it makes), host count and link rate."""

    name: str
    hosts: int
    link: str | None = None

    def __post_init__(self) -> None:
        check_name(self.name)
        if not 1 <= self.hosts <= MAX_HOSTS:
            raise UserError(f"--hosts {self.hosts}: between 1 and {MAX_HOSTS}")
        check_link(self.link)

    def host(self, i: int) -> str:
        """Host i's name: its namespace and its hostname."""
        return f"{self.name}-h{i}"

    def address(self, i: int) -> str:
        """Host i's address (inside the cluster's namespaces only)."""
        return f"{SUBNET}.{i + 1}"

    @property
    def switch(self) -> str:
        """The namespace holding the bridge every host's link plugs into."""
        return f"{self.name}-sw"

    @property
    def namespaces(self) -> list[str]:
        """Every namespace the cluster makes, the switch first."""
        return [self.switch] + [self.host(i) for i in range(self.hosts)]

    @property
    def state_dir(self) -> Path:
        """The cluster's state file and hosts files."""
        return state_root() / self.name

    def shm_dir(self, i: int) -> Path:
        """Host i's /dev/shm."""
        return shm_root() / self.name / f"h{i}"

    def hosts_file(self, i: int) -> Path:
        """Host i's /etc/hosts."""
        return self.state_dir / f"h{i}" / "hosts"

    def etc_hosts(self) -> str:
        """The /etc/hosts every host sees: localhost, then each host's name."""
        lines = ["127.0.0.1 localhost", "::1 localhost"]
        lines += [f"{self.address(i)} {self.host(i)}" for i in range(self.hosts)]
        return "\n".join(lines) + "\n"

    def index(self, host: str) -> int:
        """The index of host `host` (its name, or its number), else a UserError."""
        names = [self.host(i) for i in range(self.hosts)]
        if host in names:
            return names.index(host)
        if host.isdigit() and int(host) < self.hosts:
            return int(host)
        raise UserError(f"no host {host!r} in cluster {self.name}: its hosts are "
                        f"{', '.join(names)}")


def write_state(layout: Layout, complete: bool) -> None:
    """Record the cluster (before anything is made: complete=False; after: True)."""
    layout.state_dir.mkdir(parents=True, exist_ok=True)
    tmp = layout.state_dir / "state.json.tmp"
    tmp.write_text(json.dumps({**asdict(layout), "complete": complete}))
    os.replace(tmp, layout.state_dir / "state.json")


def read_state(name: str) -> tuple[Layout, bool] | None:
    """(the layout, whether `up` finished) of cluster `name`, None if none is recorded."""
    path = state_root() / check_name(name) / "state.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: unreadable cluster state ({e}); remove it by hand once "
                        f"`ip netns list` shows no {name}-* namespace") from e
    return Layout(data["name"], data["hosts"], data["link"]), bool(data["complete"])
