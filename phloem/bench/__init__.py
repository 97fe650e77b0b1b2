"""The `phloem bench` instrument: synthetic workloads, the roofline model (shared/docs/ROOFLINE.md),
ceilings measured in the run, and in-run peers. The CLI lives in `phloem.entrypoints.bench`."""
