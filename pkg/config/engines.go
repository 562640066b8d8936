package config

import (
	"errors"
	"fmt"
)

// How pd-extproc reaches the engines itself: the prefill legs, the pools'
// health checks, scrapes and model lists, the token ids it asks for. The
// prefill pool follows prefill.*, the decode pool pools.decode.*; the decode
// leg goes through Envoy, whose cluster carries its TLS.
//
// An API key file (prefill.api_key_file, pools.decode.api_key_file) holds
// the key that engines started with --api-key expect: pd-extproc sends it
// as "Authorization: Bearer <key>" on every request of its own to that
// pool's engines, in place of the client's, and the decode pool's key on
// the decode leg too. The file is read again when it changes (a Kubernetes
// Secret's volume); surrounding white space is not part of the key.

// EngineTLS makes the requests to a pool's engines HTTPS: prefill.tls for the
// prefill legs and the prefill pool's checks and scrapes, pools.decode.tls for
// the decode pool's.
type EngineTLS struct {
	Enabled bool `json:"enabled"`
	// CAFile is a PEM bundle of the CAs that sign the engines' certificates;
	// the system's roots when empty.
	CAFile string `json:"ca_file,omitempty"`
	// ServerName overrides the name checked in the engines' certificates
	// (they are dialled by IP).
	ServerName string `json:"server_name,omitempty"`
}

// Validate checks the TLS keys under key.
func (t EngineTLS) Validate(key string) error {
	if !t.Enabled && (t.CAFile != "" || t.ServerName != "") {
		return fmt.Errorf("%s: ca_file and server_name need %s.enabled: true", key, key)
	}
	return nil
}

// validateEngineAccess refuses the prefill pool's own TLS and key: it
// follows prefill.*.
func (c *Config) validateEngineAccess() error {
	var errs []error
	if c.Pools.Prefill.TLS != (EngineTLS{}) {
		errs = append(errs, errors.New("pools.prefill.tls: the prefill pool's checks and scrapes follow prefill.tls"))
	}
	if c.Pools.Prefill.APIKeyFile != "" {
		errs = append(errs, errors.New("pools.prefill.api_key_file: the prefill pool follows prefill.api_key_file"))
	}
	return errors.Join(errs...)
}
