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
		resp, err := Client.Do(req)
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

// Client reaches loopback servers directly, whatever HTTP_PROXY says, and
// opens a connection per request, leaving no idle one in the child. After a
// local reply sent before the request body was read the emulator closes the
// connection, and a pooled client may pick it up in that instant ("server
// closed idle connection"): a client-side race that would hide what the tests
// look at.
var Client = &http.Client{Transport: &http.Transport{Proxy: nil, DisableKeepAlives: true}}

// Post sends body to url as JSON, with header's fields too, on Client, and
// returns the response and its whole body; ctx bounds it.
func Post(ctx context.Context, url, body string, header http.Header) (*http.Response, string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		return nil, "", err
	}
	req.Header.Set("Content-Type", "application/json")
	for k, v := range header {
		req.Header[k] = v
	}
	resp, err := Client.Do(req)
	if err != nil {
		return nil, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp, string(b), err
}

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
