"""codedojo: an open training system for agentic coding models.

Stages live in sibling packages (model, engine, data, pretrain, sandbox, egress, harness,
reward, bench, rl); lower layers never import higher ones. See README.md for the pipeline.
"""

__version__ = "0.1.0"
