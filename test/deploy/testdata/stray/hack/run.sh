#!/bin/sh
# The steps are in ../team/runbook.md.
cd "$(dirname "$0")/.." && ls ./docs
