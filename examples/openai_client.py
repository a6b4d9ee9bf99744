"""Talk to `ferrox serve` with the official OpenAI client (start the server first: `ferrox serve`)."""

from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")  # or your --api-key
model = client.models.list().data[0].id
chat = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=32, temperature=0
)
print(chat.choices[0].message.content, chat.usage)
completion = client.completions.create(model=model, prompt="1, 2, 3,", max_tokens=8, temperature=0)
print(completion.choices[0].text)
