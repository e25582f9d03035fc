from openai import OpenAI

client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY name the edge's HTTP API
model = client.models.list().data[0].id
reply = client.chat.completions.create(model=model, max_tokens=48, messages=[{"role": "user", "content": "What does sorted() return?"}])
print(reply.choices[0].message.content)
