"""Calibrated predictions against measured decode: the 100M (fp32) and 1B (bf16) Llamas, resident and half on disk.

One run, side by side, because the machine is shared and its rates move with its neighbours' load. Per model:

1. predict both cases with the planner's default figures;
2. calibrate (``service.cli.calibrate.calibrate``, what ``loadmaster env --calibrate`` runs) into a scratch file, right
   before this model's decodes, so that calibration and decode see the same load;
3. predict each case with that calibration, then measure its decode tokens/s with ``bench/load.py``'s worker (our
   loader, fresh process, best of ``--repeats`` runs, each run's rate from its median gap between tokens), the
   resident and half-on-disk runs taking turns;
4. print predicted against measured, the ratio, whether it is within +-25%, the load average, and half on disk
   against resident, predicted and measured (a ratio of two rates measured side by side, which a loaded machine
   moves far less than either rate).

The prediction is made for the context actually decoded (prompt + new tokens), the same device map as measured
(``bench/offload.py``'s half-on-disk map: the second half of the layers on disk, warm page cache).

Run: ``.venv/bin/python -m bench.calibration [--models 100m,1b] [--repeats 3] [--threads N] [--out bench/results/calibration.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from bench.common import llama_dir, machine, print_table, run_isolated, write_json
from bench.offload import half_on_disk_map

LOAD_MODULE = "bench.load"
PROMPT_TOKENS = 16  # what bench.common.time_generation feeds
TOLERANCE = 0.25

COLUMNS = [
    ("model", "model"),
    ("placement", "placement"),
    ("predicted_default", "predicted (defaults) tok/s"),
    ("predicted", "predicted (calibrated) tok/s"),
    ("measured", "measured tok/s"),
    ("ratio", "predicted / measured"),
    ("within", "within +-25%"),
    ("vs_resident_predicted", "x resident, predicted"),
    ("vs_resident_measured", "x resident, measured"),
    ("load_calibration", "load avg at calibration"),
    ("load_average", "load avg at decode"),
]


def _models(names: list[str]) -> list[tuple[str, Path, str]]:
    out = []
    for name in names:
        if name == "100m":
            out.append(("llama-100m", llama_dir("100m", "float32"), "float32"))
        elif name == "1b":
            out.append(("llama-1b", llama_dir("1b", "bfloat16"), "bfloat16"))
        else:
            raise SystemExit(f"unknown model {name!r}; use 100m and/or 1b")
    return out


def _predict(path: Path, dtype: str, device_map: dict, folder: Path, context: int) -> float:
    from planner.api import plan

    strategy = "sequential" if device_map == {"": "cpu"} else device_map
    p = plan(
        str(path),
        max_memory={"cpu": "64GiB", "disk": "1TiB"},
        strategy=strategy,
        dtype=dtype,
        batch_size=1,
        context=context,
        offload_folder=str(folder),
    )
    return p.prediction.decode_tokens_per_s


def _spec(case: dict, args: argparse.Namespace, work: Path) -> dict:
    return {
        "contender": "loadmaster",
        "label": f"{case['model']} {case['placement']}",
        "path": str(case["path"]),
        "dtype": case["dtype"],
        "device_map": case["device_map"],
        "new_tokens": args.new_tokens,
        "threads": args.threads,
        "offload_folder": str(work / "offload"),
    }


def _measure(cases: list[dict], args: argparse.Namespace, work: Path, context: int) -> None:
    """Predict each of one model's cases with the calibration in force, then decode them in fresh processes, the
    placements taking turns run by run (best of ``args.repeats`` each): on a shared machine both placements then
    see the same spread of the neighbours' load, and their ratio is measured as fairly as each rate."""
    for case in cases:
        case["predicted"] = _predict(case["path"], case["dtype"], case["device_map"], work, context)
        case["measured_runs"] = []
    for _ in range(max(1, args.repeats)):
        for case in cases:
            r = run_isolated(LOAD_MODULE, _spec(case, args, work))
            if "error" in r:
                case["error"] = r["error"]
                print(r["error"])
                continue
            case["measured_runs"].append(r["decode_tok_s"])
    for case in cases:
        if not case["measured_runs"]:
            continue
        case["load_average"] = round(os.getloadavg()[0], 1)
        case["measured"] = max(case["measured_runs"])
        case["ratio"] = case["predicted"] / case["measured"]
        case["within"] = "yes" if abs(case["ratio"] - 1) <= TOLERANCE else "no"
    base = cases[0]
    for case in cases[1:]:
        if "measured" in case and "measured" in base:
            case["vs_resident_predicted"] = case["predicted"] / base["predicted"]
            case["vs_resident_measured"] = case["measured"] / base["measured"]
    for case in cases:
        row = {k: v for k, v in case.items() if k not in ("path", "device_map")}
        print(json.dumps(row), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="100m,1b")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="fresh-process decode runs per case (best kept)")
    ap.add_argument(
        "--threads", type=int, default=0, help="torch threads for calibration and decode alike (0: torch's default)"
    )
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "calibration.json"))
    args = ap.parse_args(argv)

    import torch

    import planner.hardware.calibration as pc
    from planner.hardware.calibration import machine_id
    from service.cli.calibrate import calibrate

    if args.threads:
        torch.set_num_threads(args.threads)

    models = _models(args.models.split(","))
    load_start = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="loadmaster-bench-calibration-"))
    cal_path = work / "calibration.json"
    context = PROMPT_TOKENS + args.new_tokens

    cases = []
    calibrations = {}
    for label, path, dtype in models:
        os.environ[pc.ENV_VAR] = "off"  # the default figures, not the previous model's calibration
        resident = {"": "cpu"}
        half, _ = half_on_disk_map(path)
        model_cases = []
        for placement, dm in (("resident", resident), ("half on disk (warm)", half)):
            model_cases.append(
                {
                    "model": label,
                    "placement": placement,
                    "path": path,
                    "dtype": dtype,
                    "device_map": dm,
                    "predicted_default": _predict(path, dtype, dm, work, context),
                }
            )
        # Calibrate right before this model's decodes, so both see the same neighbours' load.
        cal = calibrate(work, say=print)
        pc.save_calibration(cal, cal_path)
        os.environ[pc.ENV_VAR] = str(cal_path)
        calibrations[label] = cal.to_dict()
        for case in model_cases:
            case["load_calibration"] = round(os.getloadavg()[0], 1)
        print(cal.summary(), flush=True)
        _measure(model_cases, args, work, context)
        cases += model_cases
    print()
    table = print_table(cases, COLUMNS)
    print(
        f"torch threads {torch.get_num_threads()}; load average (1 min) {load_start[0]:.1f} at start, "
        f"{os.getloadavg()[0]:.1f} at end; {machine_id()}"
    )
    write_json(
        Path(args.out),
        {
            "bench": "calibration",
            "machine": machine(),
            "calibrations": calibrations,
            "threads": torch.get_num_threads(),
            "load_average": {"start": load_start, "end": os.getloadavg()},
            "context": context,
            "rows": [{k: (str(v) if isinstance(v, Path) else v) for k, v in c.items()} for c in cases],
            "table": table,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
