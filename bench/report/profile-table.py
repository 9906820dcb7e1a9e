#!/usr/bin/env python3
"""Prints chosen metrics of ncu raw-page CSVs side by side (scripts/gpu profile-vs-torch uses it):
bench/report/profile-table.py A.csv B.csv ... (the metric names matching any of the patterns
below, one row each)."""
import csv, re, sys

PATTERNS = [r"^gpu__time_duration\.sum$", r"^gpc__cycles_elapsed\.avg\.per_second$",
            r"^sm__cycles_elapsed\.avg\.per_second$",
            r"tensor_op_hmma_cycles_active\.avg\.pct", r"^sm__throughput\.avg\.pct",
            r"^l1tex__throughput\.avg\.pct", r"^l1tex__data_bank_(reads|writes)\.avg\.pct",
            r"^l1tex__data_pipe_lsu_wavefronts_mem_shared(_cmd_read|_cmd_write)?\.sum$",
            r"^lts__throughput\.avg\.pct", r"^lts__t_sectors\.avg\.pct",
            r"^lts__t_bytes\.sum$", r"^dram__throughput\.avg\.pct", r"^dram__bytes_(read|write)\.sum$",
            r"^l1tex__m_xbar2l1tex_read_bytes\.sum$", r"^smsp__inst_executed\.sum$",
            r"^sm__warps_active\.avg\.pct"]

cols = []
for path in sys.argv[1:]:
    rows = list(csv.reader(open(path)))
    if len(rows) < 3:
        cols.append({}); continue
    names, units, vals = rows[0], rows[1], rows[-1]
    cols.append({n: (v, u) for n, u, v in zip(names, units, vals)})
keys = sorted({k for c in cols for k in c if any(re.search(p, k) for p in PATTERNS)})
print("metric".ljust(72) + "".join(f"{i + 1:>22}" for i in range(len(cols))))
for k in keys:
    print(k[:71].ljust(72) + "".join(f"{(c.get(k, ('-', ''))[0] + ' ' + c.get(k, ('', ''))[1])[:21]:>22}" for c in cols))
