"""Constrained JSON output and penalties through the OpenAI API against a DFLASH server.

    python -m sglang.launch_server --model-path T --speculative-algorithm DFLASH \
        --speculative-draft-model-path D --port 30000
    python examples/structured_output.py --base-url http://127.0.0.1:30000

The JSON schema is enforced at every position of a verify block (the grammar state after the drafts before it),
and presence / frequency penalties count the drafts before a position as output tokens, so the replies are the
ones plain decoding gives.
"""

import argparse
import json

import openai

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "country": {"type": "string", "maxLength": 40},
                   "continent": {"enum": ["Africa", "Americas", "Asia", "Europe", "Oceania"]}},
    "required": ["city", "country", "continent"],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:30000")
    args = ap.parse_args()
    client = openai.OpenAI(base_url=f"{args.base_url}/v1", api_key="none")
    reply = client.chat.completions.create(
        model="default", temperature=0, max_tokens=200,
        messages=[{"role": "user", "content": "Describe the capital of France as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}},
    )
    if reply.choices[0].finish_reason != "stop":
        raise SystemExit(f"the JSON reply did not finish within max_tokens: {reply.choices[0].message.content!r}")
    city = json.loads(reply.choices[0].message.content)
    print("json:", city)
    reply = client.chat.completions.create(
        model="default", temperature=0, max_tokens=48, presence_penalty=0.8, frequency_penalty=0.4,
        messages=[{"role": "user", "content": "List some fruits."}],
    )
    print("penalized:", reply.choices[0].message.content)


if __name__ == "__main__":
    main()
