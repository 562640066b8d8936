package enginetest

import (
	"context"
	"net/http"
	"testing"
	"time"
)

// A test's pools scrape and check the fake engine every few milliseconds
// whether or not the test awaits those requests: none may block the engine,
// and each can still be awaited.
func TestRequestsNeverAwaitedDoNotBlockTheEngine(t *testing.T) {
	e := Start(t, JSON(http.StatusOK, `{}`))
	const n = 250
	for i := range n {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, e.URL+"/metrics", nil)
		resp, err := http.DefaultClient.Do(req)
		cancel()
		if err != nil {
			t.Fatalf("request %d: %v (the engine blocked)", i, err)
		}
		resp.Body.Close()
	}
	for range n {
		e.Await(t)
	}
	if got := len(e.Requests()); got != n {
		t.Fatalf("recorded %d requests, want %d", got, n)
	}
}
