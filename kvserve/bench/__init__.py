"""``kvserve bench``: seeded workloads driven against any OpenAI-compatible server or the
in-process engine, with the latency, throughput, goodput, KV and cost figures the seed's
playbook asks for.

workloads.py makes the requests and their arrival schedule; client.py talks HTTP and scrapes
/metrics; engine_target.py runs the engine in-process behind the same interface; runner.py
applies the load (open or closed loop); metrics.py turns records into statistics; report.py
prints, writes and plots them; cli.py is the command line.
"""
