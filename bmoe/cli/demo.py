"""``bmoe demo`` and ``bmoe make-tiny``: the commands that write a random MoE GGUF, the demo then
running it three times (resident, streamed with the cache off, streamed with the cache sized
automatically) to show all three print the same tokens."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bmoe.cli.edge import _run
from bmoe.cli.flags import _number, _tokens
from bmoe.cli.generate import _generate, _summary
from bmoe.engine.config import MiB, RunConfig
from bmoe.errors import OutputPathError
from bmoe.io.paths import fresh_partial, remove_partial

DEMO_PROMPT = "The quick brown fox jumps over the lazy dog. Streaming experts from disk:"


def _demo_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="make a synthetic MoE once, run it resident and streamed")
    p.add_argument("-n", "--n-predict", type=_tokens, default=32, help="tokens each run generates (default: 32)")
    p.add_argument("--dir", type=Path, default=None,
                   help="where to keep the demo model (default: ~/.cache/bmoe, or $XDG_CACHE_HOME/bmoe)")
    p.set_defaults(func=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    from bmoe.synth.tiny import TinySpec

    # About 400 MB; this seed's greedy text is varied (a check a random model needs).
    spec = TinySpec(arch="qwen3moe", wtype="f16", n_layer=4, n_embd=1024, n_expert=32,
                    n_expert_used=4, n_ff=512, seed=0)
    folder = _demo_folder(args.dir)
    model = folder / (f"demo-{spec.arch}-{spec.wtype}-l{spec.n_layer}-e{spec.n_embd}"
                      f"-x{spec.n_expert}-k{spec.n_expert_used}-f{spec.n_ff}-s{spec.seed}.gguf")
    if not model.exists():
        print(f"making the demo model once: {model}", file=sys.stderr)
        tmp = fresh_partial(model.with_suffix(".partial.gguf"))
        _write_with_progress(tmp, spec)  # removes what it half wrote on a signal or a full disk
        try:
            tmp.replace(model)
        except BaseException:
            remove_partial(tmp)
            raise
    print(f"demo model: {model} ({model.stat().st_size / MiB:.0f} MiB). Its weights are random, "
          "so the text is gibberish: what matters is that all three runs print the same bytes.\n")
    results = {}
    runs = {
        "resident": RunConfig(mode="resident"),
        "streamed, cache off": RunConfig(mode="stream", cache_bytes=0),
        "streamed, cache auto": RunConfig(mode="stream", cache_bytes=None),
    }
    for name, config in runs.items():
        r = _run(_generate(model, config.validate(), DEMO_PROMPT, args.n_predict, echo=False))
        results[name] = r
        print(f"{name}: {r['text']!r}")
        print(f"    {_summary(r)}")
    same = all(r["tokens"] == results["resident"]["tokens"] for r in results.values())
    print("\nidentical tokens: " + ("yes" if same else "NO (this is a bug; please report it)"))
    return 0 if same else 1


def _demo_dir(arg: Path | None) -> Path:
    from bmoe.io.probe import cache_dir

    return arg if arg is not None else cache_dir()


def _demo_folder(arg: Path | None) -> Path:
    """The demo's folder, made if missing; a file (or anything not a folder) there is one line."""
    folder = _demo_dir(arg)
    what = f"--dir {folder}" if arg is not None else f"the demo folder {folder}"
    if folder.exists() and not folder.is_dir():
        raise OutputPathError(f"{what} is {'a file, ' if folder.is_file() else ''}not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputPathError(f"{what}: cannot make it: {exc.strerror or exc}") from None
    return folder


def _tiny_parser(sub: argparse._SubParsersAction) -> None:
    from bmoe.io.recipes import RECIPES

    p = sub.add_parser("make-tiny", help="write a small random MoE GGUF (tests, measurements)")
    p.add_argument("out", type=Path, help="the .gguf file to write (with --shards: the split set beside it, "
                                          "STEM-00001-of-00003.gguf .. for 3; -m takes the first)")
    # Checked by TinySpec.validate, which names the choices (bmoe --list-archs): one line, status 1.
    p.add_argument("--arch", default="qwen3moe", metavar="ARCH",
                   help=f"architecture, one of {', '.join(sorted(RECIPES))} (default: qwen3moe)")
    p.add_argument("--type", dest="wtype", default="f32", choices=("f32", "f16", "q8_0"),
                   help="type of the weight matrices (default: f32; norms and biases stay f32, gpt-oss "
                        "experts are mxfp4)")
    p.add_argument("--shards", type=_number(int, 1, 10_000, "a shard count"), default=1,
                   help="split the file into this many shards (default: 1)")
    p.add_argument("--seed", type=_number(int, 0, 2**32 - 1, "a seed"), default=0,
                   help="seed of the random weights (default: 0)")
    p.add_argument("--layers", type=_number(int, 1, 512, "a layer count"), default=None,
                   help="main blocks (default: the arch's, 2 for most)")
    p.add_argument("--mtp", type=_number(int, 0, 8, "an MTP block count"), default=0,
                   help="MTP blocks after them (archs that have them)")
    p.add_argument("--embd", type=_number(int, 16, 16384, "an embedding width"), default=128,
                   help="embedding width, a multiple of 16 (default: 128)")
    p.add_argument("--experts", type=_number(int, 1, 1024, "an expert count"), default=8,
                   help="experts per MoE layer (default: 8)")
    p.add_argument("--used", type=_number(int, 1, 1024, "an expert count"), default=2,
                   help="experts each token routes to (default: 2)")
    p.add_argument("--ff", type=_number(int, 1, 65536, "a feed-forward width"), default=64,
                   help="each expert's feed-forward width (default: 64)")
    p.add_argument("--force", action="store_true", help="replace an existing file (never written through a link)")
    p.set_defaults(func=_cmd_make_tiny)


def _cmd_make_tiny(args: argparse.Namespace) -> int:
    from bmoe.io.paths import check_new_file, make_room
    from bmoe.synth.tiny import TinySpec, tiny_files

    spec = TinySpec(arch=args.arch, wtype=args.wtype, n_layer=args.layers, n_embd=args.embd,
                    n_expert=args.experts, n_expert_used=args.used, n_ff=args.ff, seed=args.seed,
                    shards=args.shards, n_nextn=args.mtp)
    spec.validate()  # a bad spec is one line, before any progress bar
    files = tiny_files(args.out, args.shards)
    for file in files:  # every name checked before any is replaced
        check_new_file(file, "make-tiny", force=args.force)
    for file in files:
        make_room(file, "make-tiny")
    paths = _write_with_progress(args.out, spec)
    print(paths[0])
    return 0


def _write_with_progress(out: Path, spec) -> list[Path]:  # noqa: ANN001
    from tqdm import tqdm

    from bmoe.synth.tiny import write_tiny

    with tqdm(total=None, unit="B", unit_scale=True, desc=f"writing {out.name}", file=sys.stderr,
              disable=not sys.stderr.isatty()) as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        try:
            return write_tiny(out, spec, progress)
        except BaseException as e:
            # Half-written files are not models: remove them (checked new, or --force'd away, so
            # they are this run's own), whether a write failed or Ctrl-C came.
            from bmoe.synth.tiny import tiny_files

            for file in tiny_files(out, spec.shards):
                remove_partial(file)
            if isinstance(e, OSError) and e.filename is None:
                e.filename = str(out)  # a failed write says where it was going
            raise
