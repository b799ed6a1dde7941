"""One `fastapi.APIRouter` per endpoint group; serve.app.create_app mounts a server's routers.

- `chat.py`: POST /v1/chat/completions; `completions.py`: POST /v1/completions;
- `models.py`: GET /v1/models; `scoring.py`: a reward model's POST /v1/score;
- `health.py`: GET /health; `metrics.py`: GET /metrics; `page.py`: the chat page at GET /;
- `rollout.py`: `swiftlm rollout`'s /info/, /weights/... and /generate/ (and its service).

A router only routes: what every request goes through (drain, API keys, body size, errors as
OpenAI error objects, response counts) is the app's, implemented once (serve.guard.Gate,
serve.errors), and the work is done by the service each router is built over
(serve.completions.Completions, serve.scoring.Scoring).
"""
