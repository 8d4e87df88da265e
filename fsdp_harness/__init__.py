"""What the fork's tests and benchmarks share: real FairScale FSDP on CPU processes (:mod:`.cpu_fsdp`), running a
multi-process scenario module under a timeout (:mod:`.multiprocess`, :mod:`.scenario`), the FSDP models
(:mod:`.models`), the peak-memory sampler (:mod:`.memory_sampler`), damaged checkpoint files
(:mod:`.corrupt_checkpoint`), and a real S3 server process (:mod:`.s3_server`, moto's) with a byte-counting,
fault-injecting proxy process per rank (:mod:`.s3_proxy`).

Not shipped: ``setup.py`` packages ``pytorch_lightning`` only. It imports neither ``tests`` nor the benchmarks, so
both can import it; scenario modules run as ``python -m <module>`` from the repository root.
"""
