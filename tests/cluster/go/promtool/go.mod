// Wrapper module: builds promtool for the chart's alert-rule unit tests (tests/ship/conftest.py).
module rlfleet.dev/tests/cluster/promtool

go 1.26.7

tool github.com/prometheus/prometheus/cmd/promtool

require github.com/prometheus/prometheus v0.316.0 // indirect
