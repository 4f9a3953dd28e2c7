"""llama-cpp-python's OpenAI-compatible server, with the ``GET /health`` that llama.cpp's own C++
``llama-server`` has and llama-cpp-python's app lacks (vllm-router waits for it before routing).

``python -m loopstack.bench.llama_server --model M.gguf --port P ...`` takes
llama-cpp-python's own server arguments; everything else is its app unchanged.
"""

from __future__ import annotations

import argparse
import os
from typing import cast


def main() -> None:
    import uvicorn
    from llama_cpp.server.app import create_app
    from llama_cpp.server.cli import add_args_from_model, parse_model_from_args
    from llama_cpp.server.settings import ModelSettings, ServerSettings, Settings

    parser = argparse.ArgumentParser(description=__doc__)
    add_args_from_model(parser, Settings)
    args = parser.parse_args()
    # parse_model_from_args is annotated as returning its argument's type (a class); it returns an instance
    server_settings = cast(ServerSettings, parse_model_from_args(ServerSettings, args))
    model_settings = cast(ModelSettings, parse_model_from_args(ModelSettings, args))
    app = create_app(server_settings=server_settings, model_settings=[model_settings])

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    uvicorn.run(app, host=os.getenv("HOST", server_settings.host), port=int(os.getenv("PORT", server_settings.port)),
                log_level="warning")


if __name__ == "__main__":
    main()
