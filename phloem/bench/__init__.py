"""The `phloem bench` instrument: synthetic workloads, the roofline model (shared/docs/ROOFLINE.md),
ceilings measured in the run, in-run peers, step tracing, kernel profiles and the report. The CLI
lives in `phloem.entrypoints.bench`."""
