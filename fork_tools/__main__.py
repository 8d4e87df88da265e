"""``python -m fork_tools {materialize,check,bump,refresh,export}``: the maintainer workflow, like quilt."""
import argparse
import sys
from pathlib import Path

from fork_tools import export, materialize, refresh, revision
from fork_tools.upstream import ROOT, BuildError


def command_line_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fork_tools", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("materialize", help="build pytorch_lightning/ from the upstream wheel plus patches/series")
    p.add_argument("--force", action="store_true", help="discard edits that were never refreshed into a patch")

    sub.add_parser(
        "check", help="verify that pytorch_lightning/ equals upstream + patches/series + overlay/, and the overrides"
    )
    sub.add_parser("bump", help="raise the fork revision (patches/revision) after editing a patch by hand")

    p = sub.add_parser(
        "refresh", help="write the edits made in pytorch_lightning/ into a patch, and overlay module edits to overlay/"
    )
    p.add_argument(
        "patch",
        nargs="?",
        help="patch name relative to patches/ (e.g. fork/x.patch); a new name is appended to the series; "
        "not needed when only overlay modules were edited",
    )
    p.add_argument("--subject", help="Subject line of a new patch")
    p.add_argument("--why", help="why a new patch is needed (DEP-3 Description)")
    p.add_argument("--bug", help="upstream issue or PR it relates to")

    p = sub.add_parser("export", help="write a `git am`-ready upstream PR for one patch, against upstream 1.6.5")
    p.add_argument("patch", help="patch name in patches/series, e.g. upstream/fsdp-state-dict-on-rank-0-only.patch")
    p.add_argument("--tests", nargs="*", default=[], help="new test files of ours to include in the PR")
    p.add_argument(
        "--upstream", type=Path, help="checkout of upstream at tag 1.6.5: run `git apply --check` of the output there"
    )
    p.add_argument("-o", "--output", type=Path, required=True)
    return parser


def run_check() -> int:
    """Print every problem of the tree and the revision, or that there is none; the exit status."""
    problems = refresh.check(ROOT)
    if revision.stale_revision():
        problems.append("patches/revision: the series changed since the last bump; run 'python -m fork_tools bump'")
    for line in problems:
        print(line)
    if problems:
        return 1
    print("pytorch_lightning/ equals upstream + patches/series + overlay/; every @override has a target")
    return 0


def main(argv=None) -> int:
    args = command_line_parser().parse_args(argv)
    try:
        if args.command == "materialize":
            print(materialize.materialize(force=args.force))
        elif args.command == "check":
            return run_check()
        elif args.command == "bump":
            print(f"fork revision {revision.bump_revision()}")
        elif args.command == "refresh":
            print(refresh.refresh(args.patch, subject=args.subject, why=args.why, bug=args.bug))
        elif args.command == "export":
            print(export.export(args.patch, [Path(t) for t in args.tests], args.output, upstream=args.upstream))
    except BuildError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
