"""``vmcgrad vmc --resume DIR``: the options a resumed run takes from its checkpoint, and those it refuses."""

from __future__ import annotations

from pathlib import Path

from .. import __version__
from . import _checkpoint


def resume_options(args, parser) -> None:
    """``--resume DIR``: reads the checkpoint into ``args._checkpoint`` and sets the options from it."""
    given = given_options(args, parser)
    if "out" in given and Path(given["out"]) != Path(args.resume):
        parser.error(
            f"argument --out: {args.out!r} with --resume {args.resume!r}: a resumed run writes where its "
            "checkpoint is; leave out --out"
        )
    try:
        snap = _checkpoint.read(Path(args.resume), version=__version__)
    except _checkpoint.CheckpointError as error:
        parser.error(f"argument --resume: {error}")
    saved = snap["config"]
    changed = _checkpoint.differences(saved, given)
    if changed:
        parser.error(
            "argument --resume: these options change the problem the checkpoint solves: "
            + "; ".join(changed)
            + " (leave them out to use the checkpoint's, or start a new run with another --out)"
        )
    for key, value in saved.items():
        if key not in given and key not in _checkpoint.MAY_CHANGE and hasattr(args, key):
            setattr(args, key, value)
    if "steps" not in given:
        args.steps = saved["steps"]
    done = int(snap["step"])
    if args.steps <= done:
        parser.error(
            f"argument --steps: the checkpoint in {args.resume} is at step {done} of {saved['steps']}; "
            f"give --steps larger than {done} to continue it"
        )
    args.out = args.resume
    args._checkpoint = snap


UNSET = object()


def given_options(args, parser) -> dict:
    """The options of this sub-command that the command line gives (by value), defaults left out."""
    import argparse

    argv = list(getattr(args, "_argv", ()))
    start = next((i for i, a in enumerate(argv) if not a.startswith("-")), len(argv))  # the command
    namespace = argparse.Namespace(**{key: UNSET for key in vars(args)})
    parser.parse_args(argv[start + 1 :], namespace=namespace)
    return {k: v for k, v in vars(namespace).items() if v is not UNSET and not k.startswith("_")}
