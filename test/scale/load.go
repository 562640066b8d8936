package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// model is the name the engines serve.
const model = "pdsim"

// streams is the load of one run: every request a streamed chat completion
// that stays open for the whole generation.
type streams struct {
	streaming atomic.Int64 // answered 200 and not over yet
	completed atomic.Int64 // whole: 200 and the final data: [DONE]
	failed    atomic.Int64 // an error status, or a stream cut short
	lost      atomic.Int64 // no end before the deadline

	mu           sync.Mutex
	firstFailure string
	wg           sync.WaitGroup
}

func (l *streams) fail(kind *atomic.Int64, format string, args ...any) {
	kind.Add(1)
	l.mu.Lock()
	if l.firstFailure == "" {
		l.firstFailure = fmt.Sprintf(format, args...)
	}
	l.mu.Unlock()
}

// first is the first failure, "" while there is none.
func (l *streams) first() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.firstFailure
}

// over is how many streams have ended, one way or another.
func (l *streams) over() int64 { return l.completed.Load() + l.failed.Load() + l.lost.Load() }

// openStreams sends n requests evenly over ramp, taking the emulators in
// turn, and returns at once; each request lives until its stream ends or
// deadline passes.
func openStreams(ctx context.Context, urls []string, n int, ramp time.Duration, body []byte, deadline time.Time) *streams {
	l := &streams{}
	client := &http.Client{Transport: &http.Transport{
		Proxy:              nil,
		DialContext:        (&net.Dialer{Timeout: 10 * time.Second}).DialContext,
		DisableKeepAlives:  true, // one connection per stream, as held generations each have
		DisableCompression: true,
	}}
	ctx, cancel := context.WithDeadline(ctx, deadline)
	every := ramp / time.Duration(max(n, 1))
	l.wg.Add(n)
	go func() {
		defer cancel()
		start := time.Now()
		for i := range n {
			if wait := time.Until(start.Add(time.Duration(i) * every)); wait > 0 {
				time.Sleep(wait) // pacing the ramp
			}
			go l.one(ctx, client, urls[i%len(urls)], body)
		}
		l.wg.Wait()
	}()
	return l
}

func (l *streams) one(ctx context.Context, client *http.Client, url string, body []byte) {
	defer l.wg.Done()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		l.fail(&l.failed, "%v", err)
		return
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		l.ended(err, "sending")
		return
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 300))
		l.fail(&l.failed, "status %d: %s", resp.StatusCode, b)
		return
	}
	l.streaming.Add(1)
	defer l.streaming.Add(-1)
	tail, err := readTail(resp.Body)
	switch {
	case err != nil:
		l.ended(err, "streaming")
	case !strings.HasSuffix(tail, "data: [DONE]\n\n"):
		l.fail(&l.failed, "a stream ended without [DONE]: ...%q", tail)
	default:
		l.completed.Add(1)
	}
}

// ended classes an error: past the deadline the stream is lost, else failed.
func (l *streams) ended(err error, when string) {
	if errors.Is(err, context.DeadlineExceeded) {
		l.fail(&l.lost, "%s: no end before the deadline", when)
		return
	}
	l.fail(&l.failed, "%s: %v", when, err)
}

// readTail reads a body to its end and keeps its last bytes.
func readTail(r io.Reader) (string, error) {
	buf := make([]byte, 4<<10)
	var tail []byte
	for {
		n, err := r.Read(buf)
		tail = append(tail, buf[:n]...)
		if len(tail) > 64 {
			tail = tail[len(tail)-64:]
		}
		if errors.Is(err, io.EOF) {
			return string(tail), nil
		}
		if err != nil {
			return string(tail), err
		}
	}
}

// wait blocks until the streams have all ended.
func (l *streams) wait() { l.wg.Wait() }

// chatBody is a streamed chat request of about size bytes: a system prompt
// and a user turn, which the prefill leg and the engines read as any other.
func chatBody(size int) []byte {
	const sentence = "Summarize the quarterly figures and flag anything unusual in the regional breakdown. "
	body := func(text string) []byte {
		b, _ := json.Marshal(map[string]any{
			"model": model, "stream": true, "max_tokens": 1024,
			"messages": []map[string]string{
				{"role": "system", "content": "You are a careful analyst."},
				{"role": "user", "content": text},
			},
		})
		return b
	}
	text := strings.Repeat(sentence, size/len(sentence)+1)
	b := body(text)
	if over := len(b) - size; over > 0 && over < len(text) {
		b = body(text[:len(text)-over])
	}
	return b
}
