"""`swiftlm deploy`: an OpenAI-compatible HTTP server over the continuous-batching engine.

- `app.py`: the one FastAPI app factory, and the routers a generating model and a reward model
  mount; `routes/`: one router per endpoint group (chat, completions, models, scoring, health,
  metrics, the chat page);
- `completions.py`: the two generation routes' work; `scoring.py`: a reward model's /v1/score;
- `schemas.py`: request bodies; `translate.py`: requests -> engine requests (checks included);
- `generation.py`: engine deltas into the event loop (queue bound, timeout, disconnects);
- `responses.py`: OpenAI response bodies and stream chunks; `errors.py`: OpenAI error objects;
- `guard.py` + `auth.py`: API keys, body size, shutdown; `metrics.py`: Prometheus metrics;
- `run.py`: the command (load, serve, drain on SIGTERM);
- `vision.py`: image_url parts for a vision-language model, which generates through
  engine.vision.VisionEngine (transformers' generate; continuous batching is text-only).

Needs the `serve` extra (fastapi, uvicorn, prometheus-client); importing this package alone
does not.
"""
