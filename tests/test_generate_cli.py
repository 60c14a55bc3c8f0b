"""scripts/generate.py end to end: a chat and a batch of prompts from an exported folder and from a
run directory; every user mistake is one line on stderr and exit code 2, never a traceback."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_model

from diloco.hf import save
from diloco.hf.tokenizer import load_tokenizer
from diloco.model import build

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "hf"
TINY = tiny_model(n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=128)  # test_finetune's checkpoint too


def generate(tmp_path, *overrides):
    env = {**os.environ, "XLA_FLAGS": ""}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), *overrides],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random model with the fixture tokenizer (vocab 300) and its ChatML template."""
    tok = load_tokenizer(FIXTURES / "tokenizer")
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    save(out, TINY, build(TINY, tok.vocab_size, seed=0).params, tok)
    return out


def test_chat_and_batched_prompts(folder, tmp_path):
    proc = generate(tmp_path, f"checkpoint={folder}", 'chat=["Hi there!"]', "max_new_tokens=5")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "> Hi there!" in proc.stdout and "tokens/s" in proc.stdout
    proc = generate(tmp_path, f"checkpoint={folder}", 'prompt=["one", "a longer prompt"]',
                    "max_new_tokens=4", "temperature=0.8", "top_k=20", "top_p=0.9")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "> one\n" in proc.stdout and "> a longer prompt\n" in proc.stdout
    assert "2 prompt(s)" in proc.stdout
    assert not list(tmp_path.glob("*.log"))  # Hydra writes no log file into the working directory


@pytest.mark.parametrize("overrides, message", [
    (["checkpoint=nowhere"], "nowhere: no such file or folder"),
    (["prompt=[]"], "nothing to do"),
    (["top_p=2.0"], "top_p=2.0 must be in (0, 1]"),
    (["temperature=-1"], "temperature=-1.0 must be >= 0"),
    (["max_new_tokens=1000"], "more than model.max_seq_len=128"),
    (["+colour=red"], "unknown key(s) colour"),
])
def test_user_mistakes_are_one_line_errors(folder, tmp_path, overrides, message):
    args = [f"checkpoint={folder}", 'prompt=["x"]', *overrides]
    proc = generate(tmp_path, *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_folder_without_tokenizer_and_run_without_model(tmp_path):
    proc = generate(tmp_path, f"checkpoint={FIXTURES / 'gpt2'}", 'prompt=["x"]')
    assert proc.returncode == 2 and "has no tokenizer.json" in proc.stderr
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("algo: dp\n")
    proc = generate(tmp_path, f"checkpoint={run}", 'prompt=["x"]')
    assert proc.returncode == 2 and "run directory without an exported model" in proc.stderr


def test_convert_writes_a_folder_generate_reads(folder, tmp_path):
    env = {**os.environ, "XLA_FLAGS": ""}
    out = tmp_path / "converted"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "convert.py"), f"checkpoint={folder}",
                           f"out={out}", "dtype=float32", "max_shard_bytes=20000"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "model.safetensors.index.json").exists() and (out / "chat_template.jinja").exists()
    proc = generate(tmp_path, f"checkpoint={out}", 'chat=["Hi"]', "max_new_tokens=3")
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "convert.py"), f"checkpoint={folder}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "out=<path>" in proc.stderr and "Traceback" not in proc.stderr
