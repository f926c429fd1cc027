"""`dspark models`: the known targets and whether each is provisioned."""

from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser("models", help="list known targets and whether each is provisioned")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args) -> int:
    from dspark.models import list_targets

    rows = list_targets()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        state = (
            "provisioned"
            if r["provisioned"]
            else ("package installed" if r["package_installed"] else "package missing")
        )
        print(f"{r['name']:<24} {state:<18} {r['description']}")
        print(f"{'':<24} from {r['package']} -> {r['path']}")
    return 0
