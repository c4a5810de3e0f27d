"""The documentation site's generated pages (an MkDocs hook, `mkdocs.yml`):

- `index.md`: the README, its links to `docs/X` made links to the site's `X`;
- `reference/cli.md`: every command's `--help`, from the parsers the CLI builds
  (`tpkit.cli.command_parser`);
- `reference/config.md`: `tpkit train`'s knobs, section by section, from their
  declarations (`tpkit.spec.knobs`, `TrainConfig`).

And every page's plain mention of another, `docs/X.md` in its prose, becomes a link to
it, and each section of the benchmarks' history that the current results cite ("Title",
the start of its heading) a link to that section, so that the strict build fails on a
mention of a page or a section that is gone.

Nothing here is written by hand, so neither page can fall behind a flag or a knob."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from markdown.extensions.toc import slugify
from mkdocs.structure.files import File

from tpkit.cli import COMMANDS, command_parser
from tpkit.commands.common import HelpFormatter
from tpkit.spec.knobs import Knob, sections
from tpkit.train.config import TrainConfig
from tpkit.train.config_file import to_toml, toml_value

ROOT = Path(__file__).resolve().parents[1]
WIDTH = 96  # --help's lines on the page
CODE = re.compile(r"(^ {0,3}```.*?^ {0,3}```|`[^`\n]*`)", re.M | re.S)  # blocks, spans
HISTORY = "benchmarks_history.md"
QUOTED = re.compile(r'"([^"\n]+)"')
MENTION = re.compile(r"(?<![\w/\[.-])docs/([\w/]+\.md)\b(?!\])")


def on_files(files, config):
    """Add the generated pages to the site."""
    pages = {"index.md": home(), "reference/cli.md": cli_page(),
             "reference/config.md": config_page()}
    for path, text in pages.items():
        files.append(File.generated(config, path, content=text))
    return files


def on_page_markdown(markdown, page, config, files):
    """A page's prose mentions of `docs/X.md` as links to X (code left as it is)."""
    here = posixpath.dirname(page.file.src_uri)
    parts = CODE.split(markdown)  # odd parts: code
    for i in range(0, len(parts), 2):
        parts[i] = MENTION.sub(
            lambda m: f"[docs/{m.group(1)}]({posixpath.relpath(m.group(1), here or '.')})",
            parts[i])
    markdown = "".join(parts)
    return _cite_history(markdown) if page.file.src_uri == "benchmarks.md" else markdown


def _cite_history(markdown: str) -> str:
    """The table rows' "Title"s as links to the history's section whose heading starts
    with it (as tests/test_status_table.py reads them); a title no heading starts with
    links to an anchor that does not exist, which the strict build refuses."""
    headings = re.findall(r"^#+ (.*)$", (ROOT / "docs" / HISTORY).read_text(), re.M)

    def link(m: re.Match) -> str:
        full = next((h for h in headings if h.startswith(m.group(1))), m.group(1))
        return f'["{m.group(1)}"]({HISTORY}#{slugify(full.replace("`", ""), "-")})'

    return "\n".join(QUOTED.sub(link, line) if line.startswith("| ") else line
                     for line in markdown.split("\n"))


def home() -> str:
    """The README, as the site's first page: `docs/X` links become `X`."""
    return re.sub(r"\]\(docs/", "](", (ROOT / "README.md").read_text())


def _help(name: str) -> str:
    parser = command_parser(name)
    parser.formatter_class = lambda prog: HelpFormatter(prog, width=WIDTH)
    return parser.format_help()


def cli_page() -> str:
    """`tpkit <command> --help` for every command, in `tpkit --help`'s order."""
    lines = ["# Command-line reference", "",
             "Generated from the parsers `tpkit` reads its command line with: each command's "
             "`--help`, every flag with its default. The flags of `tpkit train` are also "
             "the keys of a run's TOML file: [the configuration reference](config.md).", ""]
    lines += [f"- [`tpkit {name}`](#tpkit-{name}): {desc}" for name, (_, desc) in COMMANDS.items()]
    for name in COMMANDS:
        lines += ["", f"## tpkit {name}", "", "```text", _help(name).rstrip(), "```"]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    """Text for a Markdown table cell: pipes and angle brackets escaped."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace("\n", " ")


def _sentence(text: str) -> str:
    """`text` ending with a full stop."""
    return text if text.endswith(".") else text + "."


def _row(k: Knob) -> str:
    kind = k.kind.__name__ + (" or unset" if k.optional else "")
    what = _sentence(k.help) + (f" One of {', '.join(map(str, k.choices))}." if k.choices else "")
    if k.fixed:
        what += f" A resumed run cannot change it ({k.fixed})."
    default = "unset" if k.default is None else toml_value(k.default)
    return (f"| `{k.name}` | {kind} | `{_cell(default)}` | `{k.option}` | "
            f"{_cell(what)} |")


def config_page() -> str:
    """`tpkit train`'s knobs: one table a section, then a whole file of the defaults."""
    lines = ["# Configuration reference: `tpkit train`", "",
             "Generated from the knobs' declarations (`tpkit.spec.knobs`): each knob "
             "is a key of a run's TOML file (`tpkit train --config run.toml`, in its "
             "section) and a flag of `tpkit train` (the flag wins over the file). A run "
             "folder keeps the file it ran as `config.toml`.", ""]
    for name, knobs in sections(TrainConfig).items():
        about = knobs[0].section.about
        lines += [f"## [{name}]", "", f"{about[0].upper()}{about[1:]}.", "",
                  "| key | type | default | flag | what |", "|---|---|---|---|---|",
                  *map(_row, knobs), ""]
    lines += ["## Every key with its default", "",
              "What `tpkit train --print-config` prints with no other flag:", "",
              "```toml", to_toml(TrainConfig()).rstrip(), "```"]
    return "\n".join(lines) + "\n"

