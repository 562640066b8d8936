package testbed

import (
	"slices"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu"
)

// StartEnvoy starts the Envoy emulator on a bootstrap file of the repo
// (repository-relative, as in EnvoyConfigs, or absolute) in front of the
// ext_proc server at extprocAddr, and hands its Close to c. tweak, when set,
// changes the loaded config first.
func StartEnvoy(c Cleaner, file, extprocAddr string, tweak func(*envoyemu.Config)) (*envoyemu.Proxy, error) {
	return StartEnvoyOn(c, file, []string{extprocAddr}, tweak)
}

// StartEnvoyOn is StartEnvoy in front of several ext_proc servers, the
// endpoints of its ext_proc cluster, which take the streams in turn.
func StartEnvoyOn(c Cleaner, file string, extprocAddrs []string, tweak func(*envoyemu.Config)) (*envoyemu.Proxy, error) {
	path, err := RepoPath(file)
	if err != nil {
		return nil, err
	}
	cfg, err := envoyemu.LoadConfig(path)
	if err != nil {
		return nil, err
	}
	if tweak != nil {
		tweak(cfg)
	}
	p, err := envoyemu.Start(cfg, extprocAddrs...)
	if err != nil {
		return nil, err
	}
	c.Cleanup(func() { p.Close() })
	return p, nil
}

// ManyClients drops the client's address from cfg's ext_proc streams, which
// the shipped configs hash to pick a replica for a client that names no
// session (docs/envoy.md §14): a test's requests, all from one loopback
// address, then come as from clients whose requests leave from many
// addresses (an application's pods), whose streams the emulator gives to the
// replicas in turn.
func ManyClients(cfg *envoyemu.Config) {
	cfg.InitialMetadata = slices.DeleteFunc(cfg.InitialMetadata, envoyemu.MetadataValue.CarriesAddress)
}

// GatewayFallbacks has cfg's emulator act as a gateway of the endpoint-picker
// protocol (docs/envoy.md §8.2) with a retry policy: it takes the list that
// pools.decode.fallbacks sends, goes down it on a refused connection, a reset
// or a 503, and reports the endpoint that answered in the envoy.lb metadata
// that pd-extproc is sent.
func GatewayFallbacks(cfg *envoyemu.Config) {
	cfg.GatewayFallbacks = true
	cfg.Metadata.ForwardingNamespaces = append(cfg.Metadata.ForwardingNamespaces, "envoy.lb")
	retry := &envoyemu.RetryPolicy{On: []string{"connect-failure", "reset", "retriable-status-codes"}, NumRetries: 8, StatusCodes: []int{503}}
	for i := range cfg.Routes {
		cfg.Routes[i].Retry = retry
	}
}
