package discovery

import (
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"

	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/scheduling"
)

// BootstrapPortAnnotation on a pod gives that pod's SGLang bootstrap port
// (kv-sglang), overriding pools.prefill.bootstrap_port: the convention of
// SGLang's own gateway, for pods whose engines were started with different
// --disaggregation-bootstrap-port values.
const BootstrapPortAnnotation = "sglang.ai/bootstrap-port"

// selection is which pods of a watch are a pool's endpoints, and on which ports.
type selection struct {
	selector labels.Selector // nil selects nothing (an InferencePool not found yet)
	port     config.PodPort  // without an InferencePool
	ports    []int           // an InferencePool's target ports
}

// endpoints returns the endpoints pod gives under sel, or none and why not.
// Only a pod that is Ready, has an IP and has not run to its end (phase
// Failed or Succeeded, whatever its conditions still say, as Kubernetes
// leaves it out of a Service's endpoints) is an endpoint; with an
// InferencePool, each of its target ports is one. A terminating pod's are
// given with why "terminating": the pool uses them only when it has no
// others (poolWatch.serving). A bootstrap port annotation that is not a
// port is ignored (the pool's is used) and said in why.
func (sel selection) endpoints(pod *corev1.Pod) (eps []scheduling.Discovered, why string) {
	switch {
	case sel.selector == nil || !sel.selector.Matches(labels.Set(pod.Labels)):
		return nil, "not selected"
	case pod.Status.Phase == corev1.PodFailed || pod.Status.Phase == corev1.PodSucceeded:
		return nil, string(pod.Status.Phase)
	case pod.Status.PodIP == "":
		return nil, "no pod IP"
	case noEngine(pod) != "":
		return nil, noEngine(pod)
	case !podReady(pod):
		return nil, "not Ready"
	}
	ports := sel.ports
	if ports == nil {
		n := sel.port.Number
		if sel.port.Name != "" {
			if n = namedPort(pod, sel.port.Name); n == 0 {
				return nil, fmt.Sprintf("no container port named %q", sel.port.Name)
			}
		}
		ports = []int{n}
	}
	bootstrap, why := bootstrapPorts(pod, len(ports))
	for i, port := range ports {
		eps = append(eps, scheduling.Discovered{Addr: net.JoinHostPort(pod.Status.PodIP, strconv.Itoa(port)), BootstrapPort: bootstrap[i], ID: string(pod.UID)})
	}
	if pod.DeletionTimestamp != nil {
		why = strings.TrimSuffix("terminating; "+why, "; ")
	}
	return eps, why
}

// bootstrapPorts reads the pod's bootstrap port annotation for its n
// endpoints: one port, or with several target ports (several SGLang servers
// in one pod, each with a bootstrap server of its own) one per target port,
// comma-separated in their order. 0 where the pool's applies: no
// annotation, or one that is not that; why says which, and for one port
// named for several endpoints that it names it for each (no two servers in a
// pod can listen on it).
func bootstrapPorts(pod *corev1.Pod, n int) (ports []int, why string) {
	ports = make([]int, n)
	v, ok := pod.Annotations[BootstrapPortAnnotation]
	if !ok {
		return ports, ""
	}
	fields := strings.Split(v, ",")
	if len(fields) != 1 && len(fields) != n {
		return ports, fmt.Sprintf("annotation %s: %q names %d ports for %d target ports; the pool's bootstrap port applies", BootstrapPortAnnotation, v, len(fields), n)
	}
	for i := range ports {
		f := strings.TrimSpace(fields[min(i, len(fields)-1)])
		p, err := strconv.Atoi(f)
		if err != nil || p < 1 || p > 65535 {
			return make([]int, n), fmt.Sprintf("annotation %s: %q is not a port; the pool's bootstrap port applies", BootstrapPortAnnotation, v)
		}
		ports[i] = p
	}
	if n > 1 && len(fields) == 1 {
		why = fmt.Sprintf("annotation %s: one port, %s, for %d target ports: each SGLang server needs its own; list one per target port", BootstrapPortAnnotation, v, n)
	}
	return ports, why
}

// noEngine says why the pod's IP names no engine (config.NoEngine), "" when it
// names one.
func noEngine(pod *corev1.Pod) string {
	a, err := netip.ParseAddr(pod.Status.PodIP)
	if err != nil || config.NoEngine(a) == "" {
		return ""
	}
	return "pod IP " + pod.Status.PodIP + " is " + config.NoEngine(a)
}

func podReady(pod *corev1.Pod) bool {
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// namedPort is the number of the pod's container port called name, 0 when
// no container has one: its containers first, then its native sidecars
// (init containers that keep running, restartPolicy Always), as Kubernetes
// finds a Service's named target port (FindPort, k8s.io/endpointslice).
func namedPort(pod *corev1.Pod, name string) int {
	containers := slices.Clone(pod.Spec.Containers)
	for _, c := range pod.Spec.InitContainers {
		if c.RestartPolicy != nil && *c.RestartPolicy == corev1.ContainerRestartPolicyAlways {
			containers = append(containers, c)
		}
	}
	for _, c := range containers {
		for _, p := range c.Ports {
			if p.Name == name {
				return int(p.ContainerPort)
			}
		}
	}
	return 0
}
