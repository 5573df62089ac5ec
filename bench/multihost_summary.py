#!/usr/bin/env python3
"""The summary of bench/multihost.sh: reads the JSON files of one run (OUT) and prints Markdown
tables, side by side: the link, gradient averaging against raw MPI (tuned and coll_han) and the
link bound, the bucket-size sweep, the bf16 wire against f32, synchronize against MPI_Bcast.

Usage: multihost_summary.py OUT RATE   (RATE: the shaped link's tc rate, e.g. 2gbit)

The link bound of an allreduce of S bytes over H hosts is the 2(H-1)/H x S bytes each host must
send (S at H = 2, whatever the ranks per host), over the rate; of a broadcast, the S bytes the
root's host must send. The shaped rate is the payload TCP can carry at most on a link shaped to
RATE (1448 payload bytes per 1514-byte frame: 0.956 RATE); the unshaped "link" is a veth pair
whose rate is what the CPUs push through it, so its bound uses the rate bench_link measured (both
ways at once for an allreduce, which sends both ways; one way for a broadcast).
"""
import json
import os
import re
import sys

OUT, RATE = sys.argv[1], sys.argv[2]
PAYLOAD = 1448 / 1514


def rate_bits(r):
    m = re.fullmatch(r"([0-9.]+)([kmgt]?)bit", r.lower())
    if not m:
        raise SystemExit(f"cannot read rate {r!r} (e.g. 2gbit)")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]


def load(name):
    p = os.path.join(OUT, name)
    if not os.path.exists(p):
        return None
    with open(p) as f:
        return json.load(f)


def rc(name):
    p = os.path.join(OUT, name + ".rc")
    return open(p).read().strip() if os.path.exists(p) else None


def table(head, rows):
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for r in rows:
        print("| " + " | ".join(str(x) for x in r) + " |")
    print()


def ms(s):
    return "" if s is None else f"{s * 1e3:.1f}"


def ratio(a, b):
    return "" if a is None or b is None or b == 0 else f"{a / b:.2f}"


shaped_bits = rate_bits(RATE)
print(open(os.path.join(OUT, "machine.txt")).read() if os.path.exists(os.path.join(OUT, "machine.txt")) else "")

# --- the link ---------------------------------------------------------------------------------
print("## The link: raw MPI between two hosts (bench_link, 2 ranks, Gbit/s of payload, median)\n")
rows = []
tags = [f[5:-5] for f in sorted(os.listdir(OUT)) if f.startswith("link-") and f.endswith(".json")]
link_rate = {}  # tag -> payload bit/s for the bound of an allreduce (both ways at once)
link_one_way = {}  # tag -> payload bit/s for the bound of a broadcast (one way)
for tag in tags:
    j = load(f"link-{tag}.json")
    st = os.path.join(OUT, f"link-{tag}.status")
    q = ""
    if os.path.exists(st):
        for line in open(st):
            m = re.search(r"qdisc (tbf .*)", line)
            if m:
                q = m.group(1).strip()
                break
    g = {r["test"].split(" (")[0].split(",")[0]: r["gbit_s"] for r in j["rows"]}
    one, both, ar = g.get("one way"), g.get("both ways"), g.get("MPI_Allreduce")
    frac = f"{max(one, both, ar) / (shaped_bits * PAYLOAD / 1e9) * 100:.0f}%" if q else "(unshaped)"
    rows.append([tag, q or "none", f"{one:.2f}", f"{both:.2f}", f"{ar:.2f}", frac])
    link_rate[tag] = both * 1e9
    link_one_way[tag] = one * 1e9
table(["setting", "qdisc", "one way", "both ways, per direction", "MPI_Allreduce 64 MiB (bytes sent / s)",
       "best of the three / payload max of the rate"], rows)


print("### MPI_Allreduce of the same bytes in calls of each size (bench_link, 2 hosts x 1; ms per call)\n")
rows = []
for tag in tags:
    j = load(f"link-{tag}.json")
    if j.get("per_call"):
        rows.append([tag] + [f"{c['call_bytes'] >> 10} KiB: {c['median_s'] / c['calls'] * 1e3:.2f} "
                             f"({c['median_s'] * 1e3:.0f} in all)" for c in j["per_call"]])
if rows:
    table(["setting", "calls 1", "calls 2", "calls 3", "calls 4"], rows)


def bound_rate(tag, one_way=False):
    """payload bit/s for the link bound, and how it was got."""
    if tag == "shaped":
        return shaped_bits * PAYLOAD, f"{RATE} x 0.956"
    r = (link_one_way if one_way else link_rate).get(tag)
    return r, ("measured one way" if one_way else "measured both ways") if r else None


# --- gradient averaging -------------------------------------------------------------------------
def rows_of(doc, lst, layout):
    if not doc:
        return None
    for l in doc["lists"]:
        if l["list"] == lst:
            return l[layout]
    return None


def dist_row(block):
    for r in block["rows"]:
        if r["strategy"].startswith("lockstep: DistributedOptimizer") and "LOCKSTEP_CHECK" not in r["strategy"]:
            return r
    return None


def chunked_row(block):
    for r in block["rows"]:
        if r["strategy"].startswith("lockstep: chunked"):
            return r
    return None


print("## Gradient averaging (bench_gradsync --quick: median of 3, ms)\n")
print("Ratios: DistributedOptimizer's time over the best raw strategy with Open MPI's default collectives "
      "(tuned), over the best of tuned and coll_han, and over the link bound.\n")
rows = []
lists = []
for tag in ("unshaped", "shaped"):
    for pl in ("2x1", "2x2"):
        doc = load(f"gradsync-{tag}-{pl}.json")
        if not doc:
            continue
        for l in doc["lists"]:
            if l["list"] not in lists:
                lists.append(l["list"])
for lst in lists:
    for layout in ("separate", "flat"):
        for tag in ("unshaped", "shaped"):
            for pl in ("2x1", "2x2"):
                doc = load(f"gradsync-{tag}-{pl}.json")
                blk = rows_of(doc, lst, layout)
                if not blk:
                    continue
                d, c = dist_row(blk), chunked_row(blk)
                han = None
                han_note = ""
                if pl != "2x1":
                    hdoc = load(f"gradsync-han-{tag}-{pl}.json")
                    hblk = rows_of(hdoc, lst, layout)
                    if hblk:
                        han = hblk["best_raw_median_s"]
                        han_note = f"{ms(han)} ({hblk['best_raw'].replace('raw: ', '')})"
                    else:
                        code = rc(f"gradsync-han-{tag}-{pl}")
                        han_note = {"124": "timed out", "137": "timed out", "139": "crashed (SIGSEGV, exit 139)",
                                    None: "not run"}.get(code, f"failed (exit {code})")
                tuned = blk["best_raw_median_s"]
                best = min(x for x in (tuned, han) if x is not None)
                r, how = bound_rate(tag)
                size = next(l["bytes"] for l in doc["lists"] if l["list"] == lst)
                bound = size * 8 / r if r else None
                dm = d["median_s"] if d else None
                rows.append([lst, layout, tag, pl, ms(dm), ms(c["median_s"]) if c else "",
                             f"{ms(tuned)} ({blk['best_raw'].replace('raw: ', '')})", han_note,
                             f"{ms(bound)} ({how})" if bound else "", ratio(dm, tuned), ratio(dm, best),
                             ratio(dm, bound)])
table(["list", "layout", "link", "hosts x ranks", "DistributedOptimizer", "chunked 4 MiB (blocking)",
       "best raw, tuned", "best raw, coll_han", "link bound", "/ tuned", "/ best of tuned, han", "/ bound"], rows)

print("### Every raw strategy (ms)\n")
rows = []
for lst in lists:
    for layout in ("separate", "flat"):
        for tag in ("unshaped", "shaped"):
            for pl in ("2x1", "2x2"):
                for han in ("", "han-"):
                    blk = rows_of(load(f"gradsync-{han}{tag}-{pl}.json"), lst, layout)
                    if not blk:
                        continue
                    raws = [r for r in blk["rows"] if r["raw"]]
                    rows.append([lst, layout, tag, pl, "coll_han" if han else "tuned"] +
                                [f"{r['strategy'].replace('raw: ', '')}: {ms(r['median_s'])}" for r in raws])
table(["list", "layout", "link", "hosts x ranks", "Open MPI collectives", "raw 1", "raw 2", "raw 3"], rows)

print("### DistributedOptimizer against its bucket size, ResNet-50 (ms; raw pack buckets / flat slices of "
      "the same size beside it)\n")
rows = []
for tag in ("unshaped", "shaped"):
    for pl in ("2x1", "2x2"):
        doc = load(f"gradsync-{tag}-{pl}.json")
        if not doc:
            continue
        for l in doc["lists"]:
            for s in l.get("sweep", []):
                rows.append([tag, pl, f"{s['bytes'] / 2**20:g} MiB", s["distributed_optimizer_buckets"],
                             ms(s["distributed_optimizer_separate_s"]), ms(s["distributed_optimizer_flat_s"]),
                             ms(s["raw_pack_buckets_s"]), ms(s["raw_flat_slices_s"]), ms(s["chunked_separate_s"]),
                             ms(s["chunked_flat_s"])])
table(["link", "hosts x ranks", "bucket", "buckets (sep)", "Dist sep", "Dist flat", "raw pack sep", "raw slices flat",
       "chunked sep", "chunked flat"], rows)

# --- bf16 wire ----------------------------------------------------------------------------------
print("## bf16 on the wire against f32 (bench_scale, GradientReducer::reduce of ResNet-50, min of 1 "
      "after a warm-up, ms)\n")
rows = []
for tag in ("unshaped", "shaped"):
    for pl in ("2x1", "2x2"):
        doc = load(f"scale-{tag}-{pl}.json")
        if not doc:
            code = rc(f"scale-{tag}-{pl}")
            if code is not None:
                rows.append([tag, pl, "", "", f"failed (exit {code})", "", ""])
            continue
        for lst, v in doc["lists"].items():
            if "sync_f32_s" not in v:
                continue
            r, how = bound_rate(tag)
            rows.append([tag, pl, ms(v["sync_f32_s"]), ms(v["sync_bf16_s"]), ratio(v["sync_bf16_s"], v["sync_f32_s"]),
                         ms(v["step_replicated_s"]), ms(v["step_sharded_s"])])
table(["link", "hosts x ranks", "f32", "bf16 wire", "bf16 / f32 (target <= 0.6)", "Adam step, replicated",
       "Adam step, sharded"], rows)

# --- synchronize --------------------------------------------------------------------------------
print("## synchronize against raw MPI_Bcast (bench_synchronize --quick, model + Adam state, ms)\n")
rows = []
for tag in ("unshaped", "shaped"):
    for pl in ("2x1", "2x2"):
        doc = load(f"sync-{tag}-{pl}.json")
        if not doc:
            code = rc(f"sync-{tag}-{pl}")
            if code is not None:
                rows.append([tag, pl, "", "", f"failed (exit {code})", "", "", ""])
            continue
        for c in doc["cases"]:
            ls_row = next(r for r in c["rows"] if r["strategy"].startswith("lockstep"))
            r, how = bound_rate(tag, one_way=True)
            bound = c["bytes"] * 8 / r if r else None
            rows.append([tag, pl, f"{c['list']} {c['layout']}", f"{c['bytes'] / 2**20:.1f} MiB", ms(ls_row["median_s"]),
                         ms(c["best_raw_median_s"]), ratio(ls_row["median_s"], c["best_raw_median_s"]),
                         f"{ms(bound)} ({how})" if bound else ""])
table(["link", "hosts x ranks", "case", "bytes", "synchronize", "best raw MPI_Bcast", "ratio", "link bound"], rows)
