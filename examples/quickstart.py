"""xcosd in one script: a cloud and an edge on this machine, one generation each way.

    python examples/quickstart.py

Uses the embedded n-gram pair (no download; the first run trains it in a few
seconds and caches it under ~/.cache/xcosd). The README shows this same code.
"""

import asyncio

import xcosd
from xcosd.models import default_pair


async def main() -> None:
    draft_model, target_model = default_pair()  # embedded n-gram pair, no download
    async with xcosd.CloudNode(target=target_model, bind="tcp://127.0.0.1:0") as cloud:
        async with xcosd.EdgeNode(draft=draft_model, connect=cloud.endpoint) as edge:
            config = xcosd.GenerationConfig(method="xcosd-e", codec="f32",
                                             max_new_tokens=64, seed=7)
            res = await edge.generate("Once upon a time", config=config)
            print(res.text)
            print(res.stats.acceptance_rate, res.stats.downlink_bytes, res.finish_reason)

            # transformers' keyword names work too; text streams as it is committed
            async for piece in edge.stream("The default value of the", max_new_tokens=48,
                                           do_sample=False, stop_strings=["."]):
                print(piece, end="", flush=True)
            print()


if __name__ == "__main__":
    asyncio.run(main())
