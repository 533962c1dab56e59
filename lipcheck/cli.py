"""`lipcheck` command line: one subcommand per capability, each a thin call into experiments/*.py."""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from .report import DOCS, REPORTS, ROOT

# subcommand -> (experiment script in experiments/, report it writes)
EXPERIMENTS = {
    "wellposed": ("divergence", "divergence"),
    "certify": ("lipschitz", "lipschitz"),
    "probe": ("attention_growth", "attention_growth"),
    "bench": ("throughput", "throughput"),
    "train": ("train", "training"),
    "trained": ("trained", "trained"),  # the three verdicts on models `lipcheck train` wrote
}


def load_experiment(script: str):
    path = ROOT / "experiments" / f"{script}.py"
    if not path.exists():
        raise SystemExit(f"lipcheck: {path} not found. The experiments live in the source checkout: "
                         f"install with `pip install -e .` from a clone of the repository.")
    spec = importlib.util.spec_from_file_location(f"lipcheck_experiment_{script}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def info(argv=None) -> int:
    """Parameter counts for every preset x variant x mixer (built on the meta device: no memory)."""
    from .models.vit import PRESETS, VARIANTS, vit_from_preset
    argparse.ArgumentParser(prog="lipcheck info", description=info.__doc__).parse_args(argv)
    print(f"{'preset':6} {'variant':9} {'ssog':>12} {'attention':>12} {'saved':>8}")
    for preset in PRESETS:
        for variant in VARIANTS:
            n = {m: sum(p.numel() for p in vit_from_preset(preset, variant, m, device="meta").parameters())
                 for m in ("ssog", "attention")}
            saved = 100 * (1 - n["ssog"] / n["attention"])
            print(f"{preset:6} {variant:9} {n['ssog']:>12,} {n['attention']:>12,} {saved:>7.1f}%")
    print("paper (CIFAR-100, 224x224, three widths): 8.8-16.6% fewer parameters")
    return 0


def report(argv=None) -> int:
    """Regenerate every report that exists in docs/ by rerunning its experiment with default settings."""
    p = argparse.ArgumentParser(prog="lipcheck report", description=report.__doc__)
    p.add_argument("--quick", action="store_true", help="pass --quick to every experiment")
    p.add_argument("--all", action="store_true", help="also run experiments whose report does not exist yet")
    args = p.parse_args(argv)
    ran = 0
    for cmd, (script, name) in EXPERIMENTS.items():
        if not (args.all or (DOCS / f"{name}.md").exists()):
            continue
        if not (ROOT / "experiments" / f"{script}.py").exists():
            continue
        print(f"== lipcheck {cmd} ({'experiments/' + script + '.py'}) -> docs/{name}.md", flush=True)
        load_experiment(script).main(["--quick"] if args.quick else [])
        ran += 1
    from .report import write_index
    write_index()
    print(f"regenerated {ran} report(s); index at {DOCS / 'index.md'}")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"info": "parameter counts per preset, variant and mixer",
                "report": "regenerate every report in docs/",
                **{c: REPORTS.get(n, "") for c, (s, n) in EXPERIMENTS.items()}}
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: lipcheck <command> [options]\n\ncommands:")
        for c, what in commands.items():
            print(f"  {c:10} {what[:100]}")
        print("\n`lipcheck <command> --help` for a command's options.")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "info":
        return info(rest)
    if cmd == "report":
        return report(rest)
    if cmd in EXPERIMENTS:
        return load_experiment(EXPERIMENTS[cmd][0]).main(rest) or 0
    print(f"lipcheck: unknown command {cmd!r}; choose one of {', '.join(commands)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
