"""`lipcheck` command line: one argparse tree, one subcommand per capability, each a thin call into
lipcheck/commands/ (the same functions experiments/*.py run). Works from an installed wheel, anywhere."""
from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

from .commands.common import exit_process
from .report import docs_dir, set_command

# one name per capability: subcommand = module in lipcheck.commands = experiments/<name>.py
# -> (the report it writes in docs/, the names it also answers to, what it does)
COMMANDS = {
    "certify": ("lipschitz", ("lipschitz",), "certified bounds lower <= Lip(SSoG) <= upper (S1-S3)"),
    "probe": ("attention_growth", ("attention_growth",),
              "dense attention's Lipschitz growth, certified lower bounds (S4)"),
    "wellposed": ("divergence", ("divergence",),
                  "Picard-Lindelof on the ODE ViT: proven enclosures, sweeps, Gronwall (S5)"),
    "exactness": ("exactness", (), "the default certification's gap at every ViT grid and width"),
    "bench": ("throughput", ("throughput",), "throughput and peak memory against dense attention"),
    "train": ("training", (), "train a model (or the matched SSoG / attention comparison on digits)"),
    "trained": ("trained", (), "the three verdicts on the digits models `lipcheck train` wrote"),
}
ALIASES = {alias: name for name, (_, aliases, _) in COMMANDS.items() for alias in aliases}


def command_module(name: str):
    return importlib.import_module(f".commands.{ALIASES.get(name, name)}", __package__)


def info(args, parser) -> int:
    """Parameter counts for every preset x variant x mixer (built on the meta device: no memory)."""
    from .models.vit import PRESETS, VARIANTS, vit_from_preset
    print(f"{'preset':6} {'variant':9} {'ssog':>12} {'attention':>12} {'saved':>8}")
    for preset in PRESETS:
        for variant in VARIANTS:
            n = {m: sum(p.numel() for p in vit_from_preset(preset, variant, m, device="meta").parameters())
                 for m in ("ssog", "attention")}
            saved = 100 * (1 - n["ssog"] / n["attention"])
            print(f"{preset:6} {variant:9} {n['ssog']:>12,} {n['attention']:>12,} {saved:>7.1f}%")
    print("paper (CIFAR-100, 224x224, three widths): 8.8-16.6% fewer parameters")
    return 0


def report(args, parser) -> int:
    """Regenerate every report that exists in docs/ by rerunning its command with default settings."""
    docs = docs_dir(args.docs)
    if args.verdicts:
        return put_verdicts(docs)
    ran = 0
    for cmd, (name, _, _) in COMMANDS.items():
        if not (args.all or (docs / f"{name}.md").exists()):
            continue
        print(f"== lipcheck {cmd} -> {docs / (name + '.md')}", flush=True)
        argv = (["--quick"] if args.quick else []) + (["--docs", str(args.docs)] if args.docs else [])
        set_command([cmd, *argv])
        command_module(cmd).main(argv)
        ran += 1
    from .report import write_index
    target = docs_dir(args.docs, quick=args.quick)
    write_index(target)
    print(f"regenerated {ran} report(s); index at {target / 'index.md'}")
    return 0


def put_verdicts(docs) -> int:
    """The verdict of every report in docs/ recomputed from its JSON and put on top (no measurement is rerun)."""
    import json

    from .report import atomic_write, md_table, put_verdict, stamp, stamp_markdown
    rows = []
    for cmd, (name, _, _) in {**COMMANDS, "mutation": ("mutation", (), "")}.items():
        for path in sorted(docs.glob(f"data/{name}*.json")):
            data = json.loads(path.read_text())
            if not (docs / f"{path.stem}.md").exists() or data.get("kind") == "size_run":
                continue
            v = command_module(cmd).verdict_from(data)
            # an older stamp named the console script by its path: the command a reader types is `lipcheck ...`
            v["command"] = re.sub(r"^python \S*/bin/lipcheck\b", "lipcheck",
                                  (data.get("stamp") or {}).get("command", v["command"]))
            put_verdict(path.stem, v, docs)
            rows.append([f"[{path.stem}]({path.stem}.md)", v["statement"], f"**{v['status']}**", v["number"],
                         f"`{v['command']}`", (data.get("stamp") or {}).get("commit", "?")])
            print(f"{path.stem}: {v['status']}: {v['number']}")
    # docs/claims.md: every report's verdict in one table, the numbers the README points to
    md = ["# Claims and their verdicts", "", "Each row is the verdict on top of that report, recomputed from the "
          "numbers of its run (its JSON).", "", md_table(["report", "statement", "verdict", "how well", "reproduce",
                                                          "run at commit"], rows), ""]
    atomic_write(docs / "claims.md", stamp_markdown(stamp()) + "\n" + "\n".join(md))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lipcheck", description="lipcheck: certified Lipschitz bounds, attention growth "
                                "probes and Picard-Lindelof proofs for SSoG vision transformers. `lipcheck <command> "
                                "--help` for a command's options.")
    sub = p.add_subparsers(dest="command", metavar="<command>", title="commands")
    for name, (_, aliases, what) in COMMANDS.items():
        mod = command_module(name)
        sp = sub.add_parser(name, aliases=list(aliases), help=what, description=mod.__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(sp)
        sp.set_defaults(_parser=sp)
    sp = sub.add_parser("info", help="parameter counts per preset, variant and mixer", description=info.__doc__)
    sp.set_defaults(run=info, _parser=sp)
    sp = sub.add_parser("report", help="regenerate every report in docs/", description=report.__doc__)
    sp.add_argument("--quick", action="store_true", help="pass --quick to every command (reports go to <docs>/quick/)")
    sp.add_argument("--all", action="store_true", help="also run commands whose report does not exist yet")
    sp.add_argument("--verdicts", action="store_true", help="only recompute each report's verdict from its JSON and "
                    "put it on top (nothing is measured again)")
    sp.add_argument("--docs", default=None, help="the reports' directory (default: the checkout's docs/)")
    sp.set_defaults(run=report, _parser=sp)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    from_shell = argv is None
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    set_command(argv)  # the reports name the command as typed, wherever lipcheck is installed
    try:
        rc = args.run(args, args._parser) or 0
    finally:
        set_command(None)
    if from_shell and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        exit_process(rc)  # one rank under torchrun: leave without the teardown gloo can abort
    return rc


if __name__ == "__main__":
    sys.exit(main())
