"""An SGLang frontend-language program (gen + select) run against a DFLASH server.

    python -m sglang.launch_server --model-path T --speculative-algorithm DFLASH \
        --speculative-draft-model-path D --port 30000
    python examples/frontend_program.py --base-url http://127.0.0.1:30000
"""

import argparse

import sglang as sgl


@sgl.function
def answer_and_judge(s, question):
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=64, temperature=0))
    s += sgl.user("Is that answer correct? Reply yes or no.")
    s += sgl.assistant(sgl.select("verdict", choices=["yes", "no"]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:30000")
    args = ap.parse_args()
    sgl.set_default_backend(sgl.RuntimeEndpoint(args.base_url))
    states = answer_and_judge.run_batch([{"question": q} for q in ("What is 7 * 6?", "What is the capital of Italy?")])
    for st in states:
        print(repr(st["answer"]), "->", st["verdict"])


if __name__ == "__main__":
    main()
