"""Rewrite only the transport blocks of docs/BENCHMARKS.md from one `bench_transport.py` JSON.

`run_all.py --docs-only` re-renders every block from `out/bench/*.json` and needs all of them; this
script updates the `transport`, `ratios` and `alternatives` blocks and the transport rows of the
`targets` block (rows of the other benches are kept), for a transport-only run:

    python bench/render_transport_doc.py out/bench/transport.json
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run_all import DOC, md_alternatives, md_ratios, md_transport, targets

TRANSPORT_TARGET_MARKS = ("echo", "Redis", "Dynamo", "Ray", "in-process core", "admission p", "frames/s", "select p99")


def main(path: str) -> None:
    t = json.loads(Path(path).read_text())
    text = DOC.read_text()
    blocks = {"transport": md_transport(t), "ratios": md_ratios(t), "alternatives": md_alternatives(t)}
    m = re.search(r"<!-- generated:targets -->\n(.*?)<!-- /generated:targets -->", text, re.S)
    if m:
        lines = m.group(1).strip("\n").splitlines()
        head, body = lines[:2], lines[2:]
        kept = [ln for ln in body if not any(k in ln.split("|")[1] for k in TRANSPORT_TARGET_MARKS)]
        new = ["| " + " | ".join(r) + " |" for r in targets(t, None, None)]
        blocks["targets"] = "\n".join(head + new + kept)
    for name, body in blocks.items():
        pat = re.compile(rf"(<!-- generated:{name} -->\n)(?:.*?\n)?(<!-- /generated:{name} -->)", re.S)
        text = pat.sub(lambda mm, body=body: mm.group(1) + body + "\n" + mm.group(2), text)
    DOC.write_text(text)
    print(f"rewrote the transport blocks of {DOC}")


if __name__ == "__main__":
    main(
        sys.argv[1]
        if len(sys.argv) > 1
        else str(Path(__file__).resolve().parents[1] / "out" / "bench" / "transport.json")
    )
