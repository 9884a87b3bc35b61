"""Multi-turn chat against a DFLASH server through the OpenAI API (prefix-cache hits serve the draft too).

    python -m sglang.launch_server --model-path T --speculative-algorithm DFLASH \
        --speculative-draft-model-path D --enable-cache-report --port 30000
    python examples/openai_chat.py --base-url http://127.0.0.1:30000
"""

import argparse

import openai


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:30000")
    args = ap.parse_args()
    client = openai.OpenAI(base_url=f"{args.base_url}/v1", api_key="none")
    messages = [{"role": "system", "content": "You are a concise assistant."}]
    for question in ("Name three prime numbers.", "Which of them is the largest?", "Double it."):
        messages.append({"role": "user", "content": question})
        reply = client.chat.completions.create(model="default", messages=messages, temperature=0, max_tokens=64)
        answer = reply.choices[0].message.content
        details = reply.usage.prompt_tokens_details
        cached = details.cached_tokens if details is not None else None
        print(f"user: {question}\nassistant: {answer}\n  (prompt tokens {reply.usage.prompt_tokens}, cached {cached})")
        messages.append({"role": "assistant", "content": answer})


if __name__ == "__main__":
    main()
