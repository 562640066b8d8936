package config

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/validation"
)

// Kubernetes discovers a pool's endpoints from the Kubernetes API
// (pools.<pool>.kubernetes): the Ready pods that match a label selector, on
// one port, or the pods and target ports of an InferencePool.
type Kubernetes struct {
	// Namespace of the pods (and of the InferencePool); default: the
	// namespace pd-extproc runs in, from its service account.
	Namespace string `json:"namespace,omitempty"`
	// Selector is a label selector in Kubernetes syntax ("app=vllm,role in
	// (prefill)"). With InferencePool it is optional and ANDed with the
	// pool's own selector.
	Selector string `json:"selector,omitempty"`
	// Port is the engines' port: a number or the name of a container port.
	// Not with InferencePool, whose targetPorts give the ports.
	Port *PodPort `json:"port,omitempty"`
	// InferencePool names an InferencePool (inference.networking.k8s.io/v1)
	// in Namespace: every target port of every pod it selects is an endpoint.
	InferencePool string `json:"inference_pool,omitempty"`
}

// PodPort is a port number or the name of a container port.
type PodPort struct {
	Number int
	Name   string
}

// UnmarshalJSON takes a number (8000) or a name ("http").
func (p *PodPort) UnmarshalJSON(b []byte) error {
	if bytes.HasPrefix(b, []byte(`"`)) {
		*p = PodPort{}
		return json.Unmarshal(b, &p.Name)
	}
	n, err := strconv.Atoi(string(b))
	if err != nil {
		return badValue[PodPort](b, "a port number or a container port name")
	}
	*p = PodPort{Number: n}
	return nil
}

// MarshalJSON writes the number or the name.
func (p PodPort) MarshalJSON() ([]byte, error) {
	if p.Name != "" {
		return json.Marshal(p.Name)
	}
	return json.Marshal(p.Number)
}

func (p PodPort) String() string {
	if p.Name != "" {
		return p.Name
	}
	return strconv.Itoa(p.Number)
}

// ParsedSelector is the selector as Kubernetes reads it; everything when it
// is empty. Call it on a validated config.
func (k *Kubernetes) ParsedSelector() labels.Selector {
	s, err := labels.Parse(k.Selector)
	if err != nil {
		return labels.Nothing()
	}
	return s
}

// Validate checks the keys under key ("pools.decode.kubernetes").
func (k *Kubernetes) Validate(key string) error {
	if k == nil {
		return nil
	}
	var errs []error
	if k.Namespace != "" {
		for _, msg := range validation.IsDNS1123Label(k.Namespace) {
			errs = append(errs, fmt.Errorf("%s.namespace: %q: %s", key, k.Namespace, msg))
		}
	}
	if _, err := labels.Parse(k.Selector); err != nil {
		errs = append(errs, fmt.Errorf("%s.selector: %w", key, err))
	}
	if k.InferencePool != "" {
		for _, msg := range validation.IsDNS1123Subdomain(k.InferencePool) {
			errs = append(errs, fmt.Errorf("%s.inference_pool: %q: %s", key, k.InferencePool, msg))
		}
		if k.Port != nil {
			errs = append(errs, fmt.Errorf("%s.port: not with inference_pool, whose targetPorts are the ports", key))
		}
		return errors.Join(errs...)
	}
	if strings.TrimSpace(k.Selector) == "" {
		errs = append(errs, fmt.Errorf("%s.selector: required without inference_pool (a pool of every pod in the namespace is a mistake)", key))
	}
	switch {
	case k.Port == nil:
		errs = append(errs, fmt.Errorf("%s.port: required without inference_pool: a number or a container port name", key))
	case k.Port.Name != "":
		for _, msg := range validation.IsValidPortName(k.Port.Name) {
			errs = append(errs, fmt.Errorf("%s.port: %q is not a container port name: %s", key, k.Port.Name, msg))
		}
	case k.Port.Number < 1 || k.Port.Number > 65535:
		errs = append(errs, fmt.Errorf("%s.port: %d is not a port", key, k.Port.Number))
	}
	return errors.Join(errs...)
}
