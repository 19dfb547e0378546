"""Bad input at the runner, tried as a careless user would: each case runs
``python -m jaxflow.run`` in a subprocess on a small broken file or value and is *clean* when it
exits 2 with one stderr line (``python -m jaxflow.run: error: ...``, no traceback) naming the bad
file or value, and leaves no run directory behind.

    python experiments/scripts/bad_input_cases.py [--out cases.json] [-k SUBSTRING]

Prints one line per case and the count (cases tried, clean); ``--out`` writes them as JSON.
The tiny Hugging Face checkpoint and tokenizer come from ``tests/_hf_fixtures.py`` (run from the
repository root).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import struct
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROG = "python -m jaxflow.run: error:"


def _hf_base(tmp: pathlib.Path) -> pathlib.Path:
    """A valid tiny Qwen3 checkpoint + tokenizer (the one every HF case copies and breaks)."""
    sys.path.insert(0, str(ROOT))
    from jaxflow.models.hf_checkpoint import write_random_checkpoint
    from tests._hf_fixtures import tiny_qwen3, write_tokenizer

    base = tmp / "hf_base"
    write_random_checkpoint(tiny_qwen3(), str(base))
    write_tokenizer(str(base))
    return base


def _edit_json(name: str, fn):
    def apply(d: pathlib.Path):
        path = d / name
        path.write_text(json.dumps(fn(json.loads(path.read_text()))))
    return apply


def _write(name: str, data: bytes):
    def apply(d: pathlib.Path):
        (d / name).write_bytes(data)
    return apply


def _safetensors(d: pathlib.Path) -> pathlib.Path:
    return next(d.glob("*.safetensors"))


def _truncate(d: pathlib.Path):
    f = _safetensors(d)
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _garbage_header(d: pathlib.Path):
    f = _safetensors(d)
    raw = f.read_bytes()
    f.write_bytes(struct.pack("<Q", 40) + b"{not json" + raw[17:])


def _retype(kind: str):
    """Rewrites the first tensor's header dtype to the ``kind`` ("I" int, "U" unsigned) of the
    same byte width (F32 -> I32, BF16 -> I16, ...), its bytes left as they are."""
    def apply(d: pathlib.Path):
        f = _safetensors(d)
        raw = f.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        name = next(k for k in header if k != "__metadata__")
        width = {"F64": "64", "F32": "32", "BF16": "16", "F16": "16"}[header[name]["dtype"]]
        header[name]["dtype"] = kind + width
        new = json.dumps(header, separators=(",", ":")).encode()
        new += b" " * (n - len(new))
        if len(new) != n:
            raise RuntimeError("header grew")
        f.write_bytes(raw[:8] + new + raw[8 + n:])
    return apply


def _drop_tensor(d: pathlib.Path):
    from safetensors.numpy import load_file, save_file

    f = _safetensors(d)
    tensors = load_file(str(f))
    tensors.pop(next(k for k in tensors if "layers.0.mlp" in k))
    save_file(tensors, str(f))


def _hf_cases():
    cal = ["--exp=calibration_tradeoffs", "--variant=quick"]
    return [
        ("hf config.json is a list", cal, _write("config.json", b"[1, 2]")),
        ("hf config.json not UTF-8", cal, _write("config.json", b'{"model_type": "qw\xe9n3"}')),
        ("hf config.json not JSON", cal, _write("config.json", b'{"model_type": ')),
        ("hf config lacks hidden_size", cal,
         _edit_json("config.json", lambda c: {k: v for k, v in c.items() if k != "hidden_size"})),
        ("hf config 0 heads", cal, _edit_json("config.json", lambda c: {**c, "num_attention_heads": 0})),
        ("hf config heads a string", cal,
         _edit_json("config.json", lambda c: {**c, "num_attention_heads": "two"})),
        ("hf unknown architecture", cal, _edit_json("config.json", lambda c: {
            **c, "model_type": "mamba9", "architectures": ["Mamba9ForCausalLM"]})),
        ("hf truncated safetensors", cal, _truncate),
        ("hf safetensors garbage header", cal, _garbage_header),
        ("hf int weights", cal, _retype("I")),
        ("hf missing tensor", cal, _drop_tensor),
        ("hf tokenizer.json not JSON", ["--exp=sis_offpolicy", "--variant=quick"],
         _write("tokenizer.json", b"{oops")),
        ("hf tokenizer.json not UTF-8", ["--exp=sis_offpolicy", "--variant=quick"],
         _write("tokenizer.json", b'{"model": "\xff"}')),
        ("hf tokenizer_config.json a list", ["--exp=sis_offpolicy", "--variant=quick"],
         _write("tokenizer_config.json", b"[]")),
    ]


def _file_cases():
    cal = ["--exp=calibration_tradeoffs", "--variant=quick"]
    dlrm = ["--exp=dlrm_train", "--variant=quick", "--set", "data.source=movielens"]
    return [
        ("task file not JSON", cal, "eval_files", "t.jsonl", b'{"prompt": "x"\n'),
        ("task file a list line", cal, "eval_files", "t.jsonl", b'[1]\n'),
        ("task file no answer", cal, "eval_files", "t.jsonl", b'{"prompt": "x"}\n'),
        ("task file latin-1", cal, "eval_files", "t.jsonl",
         '{"prompt": "caf\u00e9", "answer": "1"}\n'.encode("latin-1")),
        ("calibration file latin-1", cal, "calibration_files", "web.txt",
         "caf\u00e9 au lait\n".encode("latin-1")),
        ("movielens lacks a column", dlrm, "data.path", "r.dat", b"1::2::4::100\n2::3::4\n"),
        ("movielens not UTF-8", dlrm, "data.path", "r.dat", b"1::2::4::100\n2::3::4::1\xff\n"),
        ("movielens negative id", dlrm, "data.path", "r.dat", b"1::2::4::100\n-2::3::4::100\n"),
        ("movielens id past int32", dlrm, "data.path", "r.dat",
         b"1::2::4::100\n2147483653::3::4::100\n"),
        ("movielens empty", dlrm, "data.path", "r.dat", b"\n"),
        ("movielens missing file", dlrm, "data.path", None, None),
    ]


VALUE_CASES = [
    ("max_digits 100", ["--exp=lm_pretrain", "--variant=quick", "--set", "data.max_digits=100"]),
    ("heldout_mod 0", ["--exp=lm_pretrain", "--variant=quick", "--set", "data.heldout_mod=0"]),
    ("seed of 23 digits", ["--exp=lm_pretrain", "--variant=quick", "--set",
                           "seed=12345678901234567890123"]),
    ("flowtrain heldout_mod 1", ["--exp=flowtrain", "--variant=quick", "--set", "data.heldout_mod=1"]),
    ("flexmarl max_digits 12", ["--exp=flexmarl", "--variant=quick", "--set", "max_digits=12"]),
    ("dlrm movielens without a path", ["--exp=dlrm_train", "--variant=quick", "--set",
                                       "data.source=movielens"]),
]


def _run(argv: list[str], out: pathlib.Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("JAX_PLATFORMS", "cpu")
    proc = subprocess.run([sys.executable, "-m", "jaxflow.run", *argv, f"--out={out}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    err = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    clean = (proc.returncode == 2 and len(err) == 1 and err[0].startswith(PROG)
             and "Traceback" not in proc.stderr and not out.exists())
    return {"rc": proc.returncode, "clean": clean, "stderr": err[-1][:300] if err else "",
            "stderr_lines": len(err), "left_run_dir": out.exists()}


def cases(tmp: pathlib.Path):
    """(name, make) of every case; ``make()`` writes its files under ``tmp`` and gives the argv."""
    base: list = []

    def hf(name, argv, breaks):
        if not base:
            base.append(_hf_base(tmp))
        d = tmp / name.replace(" ", "_")
        shutil.copytree(base[0], d)
        breaks(d)
        return [*argv, "--set", f"model.hf_path={d}"]

    def user_file(name, argv, key, fname, data):
        if fname is None:
            return [*argv, "--set", f"{key}={tmp / 'no_such_file.dat'}"]
        d = tmp / name.replace(" ", "_")
        d.mkdir()
        (d / fname).write_bytes(data)
        return [*argv, "--set", f"{key}={d / fname}"]

    for case in _hf_cases():
        yield case[0], lambda case=case: hf(*case)
    for case in _file_cases():
        yield case[0], lambda case=case: user_file(*case)
    for name, argv in VALUE_CASES:
        yield name, lambda argv=argv: argv


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the cases and outcomes as JSON here")
    p.add_argument("-k", default="", help="only cases whose name contains this")
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        for i, (name, make) in enumerate(cases(tmp)):
            if args.k not in name:
                continue
            argv = make()
            r = {"case": name, "argv": argv, **_run(argv, tmp / f"run{i}")}
            results.append(r)
            print(f"{'clean' if r['clean'] else 'NOT CLEAN':9} rc={r['rc']} {name}: {r['stderr']}",
                  flush=True)
    n_clean = sum(r["clean"] for r in results)
    print(f"{len(results)} cases tried, {n_clean} clean")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=1))
    return 0 if n_clean == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
