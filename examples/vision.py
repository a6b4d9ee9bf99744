"""Images with a vision-language model: the offline API and a served model's OpenAI chat.

    python examples/vision.py MODEL_FOLDER IMAGE [--serve-url http://localhost:8000]

MODEL_FOLDER: a LLaVA, LLaVA-NeXT, Gemma 3 (4B+), Gemma 4, SmolVLM/Idefics3, Qwen2-VL/Qwen2.5-VL or Mistral 3 checkpoint
already on disk (ferrox downloads nothing). IMAGE: a file path or an http(s) URL. With --serve-url, the same
question goes to `ferrox serve MODEL_FOLDER` through the openai client, the image as a data URL.
"""

import argparse
import base64
import mimetypes

from ferrox import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("image")
    parser.add_argument("--serve-url")
    args = parser.parse_args()
    question = "Describe this image in one sentence."
    if args.serve_url:
        from openai import OpenAI

        url = args.image
        if not url.startswith(("http://", "https://")):
            kind = mimetypes.guess_type(url)[0] or "image/png"
            with open(url, "rb") as f:
                url = f"data:{kind};base64," + base64.b64encode(f.read()).decode()
        client = OpenAI(base_url=args.serve_url + "/v1", api_key="none")
        reply = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=64, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": question}]}])
        print(reply.choices[0].message.content)
        return
    # Offline: a local file must sit under allowed_local_media_path (vLLM's rule), or pass a PIL image.
    import os

    llm = LLM(args.model, allowed_local_media_path=os.path.dirname(os.path.abspath(args.image))
              if os.path.exists(args.image) else None)
    source = os.path.abspath(args.image) if os.path.exists(args.image) else args.image
    out = llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": source}},
                                                 {"type": "text", "text": question}]}],
                   SamplingParams(max_tokens=64, temperature=0))
    print(out[0].outputs[0].text)
    print(f"({len(out[0].prompt_token_ids)} prompt tokens, the image's included)")


if __name__ == "__main__":
    main()
