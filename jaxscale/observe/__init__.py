"""What a run reports about itself: metrics and their files (`metrics`), step time and
throughput (`timing`), the progress line (`progress`), profiler windows (`profiling`) and the
memory a device holds and the compiled step needs (`device_memory`)."""
