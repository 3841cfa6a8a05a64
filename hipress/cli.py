"""The ``hipress`` command: developer tools around the runtime.

    hipress compll build SPEC [-o DIR]   generate a CompLL spec's sources for inspection
    hipress compll list                  list the shipped specs and their codecs
    hipress profile [-o FILE]            measure this cluster for SeCoPa (under hipressrun)
    hipress plan --profile FILE ...      plan selective compression and partitioning

(``hipressrun`` launches training jobs; this command is for tools.)

Each top-level command is one function decorated with :func:`command` that adds its
sub-parser and sets ``func`` on it; adding ``hipress profile`` or ``hipress plan`` means
adding such a function in this module (or in a module imported here), nothing else.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, List, Optional

from hipress.errors import HiPressError

#: Functions that add one top-level command each (see :func:`command`).
COMMANDS: List[Callable[[argparse._SubParsersAction], None]] = []


def command(fn: Callable[[argparse._SubParsersAction], None]) -> Callable:
    """Register a function that adds a top-level command to the ``hipress`` parser.

    The function receives the parser's sub-parsers object, adds its parser and sets
    ``func`` (called with the parsed arguments; returns the exit status or None).
    """
    COMMANDS.append(fn)
    return fn


# --------------------------------------------------------------------------- compll
@command
def _compll_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "compll", help="CompLL code generator (specs -> CPU and CUDA kernels)",
        description="Work with CompLL specs (*.hpc): generate their code, list shipped ones.")
    sub = p.add_subparsers(dest="compll_command", metavar="{build,list}")
    sub.required = True
    b = sub.add_parser(
        "build", help="write the generated sources of a spec",
        description="Parse, type-check and generate a spec; write <name>.py (the codec module: "
                    "host code and Numba kernels), <name>.cu (CUDA kernels) and "
                    "<name>.plan.txt (the fused loops) into DIR.")
    b.add_argument("spec", help="a .hpc file, or the name of a shipped spec (e.g. onebit)")
    b.add_argument("-o", "--output", default=".", metavar="DIR",
                   help="output folder (created if missing; default: current folder)")
    b.set_defaults(func=_compll_build)
    ls = sub.add_parser("list", help="list the shipped specs",
                        description="List the shipped specs with their codec names, ids, "
                                    "flags, parameters and line counts.")
    ls.set_defaults(func=_compll_list)


def _spec_file(spec: str) -> str:
    from hipress import compll

    if os.path.isfile(spec):
        return spec
    shipped = compll.spec_path_for(spec)
    if shipped is None:
        names = ", ".join(os.path.basename(p)[:-4] for p in compll.builtin_spec_paths())
        raise FileNotFoundError(f"no spec file {spec!r} and no shipped spec of that name "
                                f"(shipped: {names})")
    return shipped


def _compll_build(args: argparse.Namespace) -> int:
    from hipress import compll

    path = _spec_file(args.spec)
    with open(path, encoding="utf-8") as f:
        source = f.read()
    built = compll.build_sources(source, path)
    os.makedirs(args.output, exist_ok=True)
    name = built["name"]
    for suffix, key in ((".py", "module"), (".cu", "cuda"), (".plan.txt", "plan")):
        out = os.path.join(args.output, name + suffix)
        with open(out, "w", encoding="utf-8") as f:
            f.write(built[key])
        print(out)
    print(f"codec {built['codec_name']!r} (id {compll.codec_id_for(name)}), "
          f"spec sha256 {built['digest'][:16]}")
    sys.stdout.write(built["plan"])
    return 0


def _compll_list(args: argparse.Namespace) -> int:
    from hipress import compll

    print(f"{'spec':10s} {'codec':18s} {'id':>6s} {'lines':>5s}  flags; parameters")
    for path in compll.builtin_spec_paths():
        cls = compll.load_spec(path)
        mod = cls.spec
        flags = [k for k, v in mod.FLAGS.items() if v]
        params = [f"{p['name']}={p['default']!r} {p['range']}" for p in mod.PARAMS]
        lines = sum(1 for ln in mod.SOURCE.splitlines() if ln.strip())
        print(f"{mod.SPEC_NAME:10s} {cls.name:18s} {cls.codec_id:6d} {lines:5d}  "
              f"{', '.join(flags) or '-'}; {', '.join(params) or '-'}")
    print(f"cache: {compll.cache_dir()}")
    return 0


# --------------------------------------------------------------------------- secopa
@command
def _secopa_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add ``hipress profile`` and ``hipress plan`` (see :mod:`hipress.secopa.cli`)."""
    from hipress.secopa.cli import add_commands

    add_commands(subparsers)


# ----------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    """Return the ``hipress`` argument parser with every registered command."""
    parser = argparse.ArgumentParser(
        prog="hipress", description="HiPress developer tools (launch jobs with hipressrun).")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for add in COMMANDS:
        add(subparsers)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Run the ``hipress`` command; return its exit status.

    Errors HiPress raises on purpose (an invalid spec, a missing file) are printed as one
    message, without a traceback, and give exit status 1.
    """
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (HiPressError, FileNotFoundError) as exc:
        print(f"hipress: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
