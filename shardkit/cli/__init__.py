"""The `shardkit` command line (entry point: shardkit.cli.main:main).

main (the commands and their dispatch), parser (argparse with "did you mean"), args (shared help
text), info / info_report (`shardkit info`), launch (`shardkit launch`) and launch_agent (torchrun
as launch runs it), interrupts (Ctrl-C while starting); demo, plan, consolidate and inspect live
beside what they drive (shardkit/demo, planner, checkpoint).
"""
