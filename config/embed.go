// Package config carries the default extproc configuration, embedded in the binary.
package config

import _ "embed"

// DefaultYAML is config/extproc.yaml.
//
//go:embed extproc.yaml
var DefaultYAML []byte
