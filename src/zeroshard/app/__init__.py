"""The application: `zeroshard train|compare|estimate|plan|consolidate`, a small GPT and its data.

It is a user of zeroshard like any other: it imports only the public API (`import zeroshard`,
`zeroshard.hf`) and the paper model (`zeroshard.paper`), never the core's modules.

May import: the public API (zeroshard, zeroshard.hf), zeroshard.paper and zeroshard.parallel.
"""
