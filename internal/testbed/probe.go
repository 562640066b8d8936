package testbed

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// A child's HTTP servers, as the testbed and its users ask them: is it
// ready, and what do its metrics say.

// HTTPOK is a readiness check: GET url answers 200.
func HTTPOK(url string) func(context.Context) error {
	return func(ctx context.Context) error {
		ctx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return err
		}
		resp, err := probeClient.Do(req)
		if err != nil {
			return err
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("GET %s: %s", url, resp.Status)
		}
		return nil
	}
}

// probeClient reaches loopback servers directly, whatever HTTP_PROXY says,
// and leaves no idle connection in the child.
var probeClient = &http.Client{Transport: &http.Transport{Proxy: nil, DisableKeepAlives: true}}

// ErrNoSample is Metric's error when /metrics has no such series.
var ErrNoSample = errors.New("no such sample")

// Metric reads one sample from the Prometheus /metrics of the admin server at
// adminAddr: the first line that starts with series (a metric name, with its
// labels if they matter) and a space.
func Metric(ctx context.Context, adminAddr, series string) (float64, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+adminAddr+"/metrics", nil)
	if err != nil {
		return 0, err
	}
	resp, err := metricsClient.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, err
	}
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, series+" "); ok {
			return strconv.ParseFloat(strings.TrimSpace(v), 64)
		}
	}
	return 0, fmt.Errorf("%s/metrics: %s: %w", adminAddr, series, ErrNoSample)
}

// metricsClient keeps its connection: tests poll /metrics while they wait.
var metricsClient = &http.Client{Transport: &http.Transport{Proxy: nil}}
